#!/usr/bin/env bash
# One set-up for `make demo`, `make test` and CI: system packages, a virtualenv, torch
# (pinned: an open range would pull a multi-GB CUDA build), the package with its native
# kernels and the optional parts that install on this machine. Safe to run again: each
# step is skipped when its result is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
# torchvision (recipes only) is installed by scripts/setup_torchvision.sh, kept only if it imports.
export TORCHVISION_PIN=${TORCHVISION_PIN-torchvision==0.28.0}

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# 1. Open MPI (and iproute2 for the emulated cluster) from Debian packages when missing.
need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin libopenmpi-dev)
[ -e /usr/include/x86_64-linux-gnu/openmpi ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include ] \
  || command -v mpicc >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)
# A C++ compiler for the native kernels, cmake for Horovod's build.
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing ${need_apt[*]} (apt-get)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# 2. The virtualenv.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# 3. torch first, pinned, so nothing below can pull another build.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${TORCH_PIN#torch==}')" 2>/dev/null; then
  log "installing $TORCH_PIN"
  "${PIP[@]}" "$TORCH_PIN"
fi

# 4. The package (editable, with its native extension) and the dev/recipe extras.
stamp="$VENV/.commopt-deps"
editable_mode=compat
deps_hash=$( (cat pyproject.toml setup.py; echo "$editable_mode") | sha1sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$deps_hash" ]; then
  log "installing commopt with its extras (dev, recipes, triton: the GPU kernels, run interpreted in the tests; lightning, accelerate: the framework integrations)"
  "${PIP[@]}" setuptools wheel
  # The constraint keeps torch at the pinned build whatever an extra asks for.
  echo "$TORCH_PIN" > "$VENV/constraints.txt"
  # compat: the editable install is a plain path in a .pth file, not an import hook. The hook's
  # import at every interpreter start (before any commopt code) turned a Ctrl-C that came
  # then into a RuntimeError that site.py swallows (Python 3.11): `commopt launch` ran on.
  "${PIP[@]}" -c "$VENV/constraints.txt" --no-build-isolation \
    --config-settings editable_mode="$editable_mode" -e ".[dev,recipes,triton,lightning,accelerate]"
  echo "$deps_hash" > "$stamp"
fi

# 4b. torchvision for the recipes: installed, then removed with the fix printed when its
# wheel (a CUDA build on the registry) cannot import next to this torch.
bash scripts/setup_torchvision.sh "$VENV"

# 5. The native libraries (kernels, deadlines): rebuilt when one is missing or a source is
# newer than the oldest of them.
so=$(ls -tr commopt_ext/_cpu*.so commopt_ext/_deadline*.so 2>/dev/null | head -n1 || true)
count=$(ls commopt_ext/_cpu*.so commopt_ext/_deadline*.so 2>/dev/null | wc -l)
if [ "$count" -lt 2 ] || [ -n "$(find commopt_ext -name '*.cpp' -newer "$so" -o -name '*.h' -newer "$so" | head -n1)" ]; then
  log "building native kernels"
  "$VENV/bin/python" setup.py -q build_ext --inplace >/dev/null
fi

# 6. Optional parts that build here (Horovod), each in its own script so a failure is named.
if [ -x scripts/setup_optional.sh ]; then
  bash scripts/setup_optional.sh "$VENV"
fi
log "ready: $("$VENV/bin/python" -c 'import torch, commopt; print("torch", torch.__version__, "commopt", commopt.__version__)')"
