#!/usr/bin/env bash
# torchvision for the recipes, kept only where it imports. Called by scripts/setup.sh:
#
#   bash scripts/setup_torchvision.sh .venv
#
# The registry's torchvision wheels are CUDA builds: next to a CPU build of torch their
# native operators fail to register ("operator torchvision::nms does not exist") and
# `import torchvision` raises. This script installs TORCHVISION_PIN (from TORCHVISION_INDEX
# when set, e.g. PyTorch's CPU index), checks that it imports, and otherwise uninstalls it
# and says how to get a build that matches torch. A torchvision that is already installed
# but does not import is removed the same way. The recipes use their built-in ResNet-50 and
# synthetic images when torchvision is absent. Never fails the set-up.
#
#   TORCHVISION_PIN     what to install (default torchvision==0.28.0, the release for torch
#                       2.13); empty: install nothing, only check what is there
#   TORCHVISION_INDEX   an index URL for that install (default: the configured registry)
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${VENV:-.venv}}
PY="$VENV/bin/python"
TORCHVISION_PIN=${TORCHVISION_PIN-torchvision==0.28.0}
TORCHVISION_INDEX=${TORCHVISION_INDEX:-}
CPU_INDEX=https://download.pytorch.org/whl/cpu

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
warn() { printf '\033[1;33m[setup] warning:\033[0m %s\n' "$*" >&2; }

installed() { "$PY" -c "import importlib.metadata as m; print(m.version('torchvision'))" 2>/dev/null; }
import_error() { "$PY" -c "import torchvision, torchvision.models, torchvision.datasets" 2>&1 | tail -n 1; }
imports() { "$PY" -c "import torchvision, torchvision.models, torchvision.datasets" >/dev/null 2>&1; }
torch_version() { "$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "(torch not installed)"; }

remove_broken() {  # $1: why
  local version
  version=$(installed)
  "$PY" -m pip uninstall -y -q torchvision >/dev/null 2>&1
  if [ -n "$(installed)" ]; then
    warn "torchvision $version does not import here ($1) and could not be uninstalled:" \
         "run '$PY -m pip uninstall torchvision'"
    return
  fi
  warn "removed torchvision $version: it does not import next to torch $(torch_version) ($1)." \
       "The registry's wheels are CUDA builds; the recipes now use their built-in ResNet-50 and synthetic" \
       "images. For torchvision on a CPU torch, install the CPU build from PyTorch's index, the" \
       "release that matches torch (0.28 for torch 2.13):" \
       "'$PY -m pip install ${TORCHVISION_PIN:-torchvision==0.28.0} --index-url $CPU_INDEX'" \
       "(or rerun the set-up with TORCHVISION_INDEX=$CPU_INDEX)."
}

# A torchvision left by an earlier set-up (or by hand) that does not import goes first.
if [ -n "$(installed)" ]; then
  if imports; then
    exit 0
  fi
  remove_broken "$(import_error)"
fi
[ -z "$TORCHVISION_PIN" ] && exit 0

# Try the install once per (pin, index, torch): a known-bad combination is not downloaded
# again on every run.
stamp="$VENV/.commopt-torchvision"
want="$TORCHVISION_PIN ${TORCHVISION_INDEX:-registry} torch $(torch_version)"
[ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && exit 0
echo "$want" > "$stamp"

log "installing $TORCHVISION_PIN${TORCHVISION_INDEX:+ from $TORCHVISION_INDEX}"
constraints=()
[ -f "$VENV/constraints.txt" ] && constraints=(-c "$VENV/constraints.txt")  # keeps torch as it is
if ! "$PY" -m pip install -q --disable-pip-version-check "${constraints[@]}" \
     ${TORCHVISION_INDEX:+--index-url "$TORCHVISION_INDEX"} "$TORCHVISION_PIN"; then
  warn "$TORCHVISION_PIN could not be installed; the recipes use their built-in ResNet-50."
  exit 0
fi
if imports; then
  log "torchvision $(installed) imports: the recipes use torchvision's ResNet-50 and FakeData"
else
  remove_broken "$(import_error)"
fi
exit 0
