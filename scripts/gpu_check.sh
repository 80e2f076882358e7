#!/usr/bin/env bash
# The GPU check on a machine as it comes: the image's python3, this tree on PYTHONPATH, no
# network, no virtual environment. Results go to $OUT (default out/gpu-check):
# gpu-check.json, gpu-check.md and gpu-check-logs.txt. Options go to the module:
#   bash scripts/gpu_check.sh                    # on a GPU machine, within 8 minutes
#   bash scripts/gpu_check.sh --rehearse         # without a GPU: CPU stand-ins (~40 s of CPU)
#   GPU_CHECK_PYTHON=.venv/bin/python bash scripts/gpu_check.sh --report docs/benchmarks-gpu.md
# See docs/benchmarks-gpu.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${GPU_CHECK_PYTHON:-python3}"
out="${OUT:-$root/out/gpu-check}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$root"
# mpi4py installs without an MPI library. Where none loads and .whl/ holds an mpich wheel
# (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 mpich), its libmpi serves MPI singletons (a world of one); its own
# mpirun stays off the PATH.
if [ -z "${MPI4PY_LIBMPI:-}" ] && ! "$python" -c "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI" 2>/dev/null; then
  wheel=$(ls "$root"/.whl/mpich-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$wheel" ]; then
    dir="${TMPDIR:-/tmp}/commopt-mpich"
    rm -rf "$dir" && "$python" -m zipfile -e "$wheel" "$dir"
    lib=$(ls "$dir"/mpich-*.data/data/lib/libmpi.so.12 2>/dev/null | head -n 1 || true)
    if [ -n "$lib" ] && MPI4PY_LIBMPI="$lib" "$python" -c "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI" 2>/dev/null; then
      export MPI4PY_LIBMPI="$lib"
      echo "[gpu-check] MPI library from the carried wheel: $lib"
    else
      echo "[gpu-check] the carried wheel $wheel gave no loadable libmpi: MPI stages will say so"
    fi
  fi
fi
exec "$python" -m commopt.gpu_check --out "$out" "$@"
