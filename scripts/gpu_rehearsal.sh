#!/usr/bin/env bash
# The GPU check rehearsed without a GPU on the GPU image's versions (Python 3.12, torch 2.11.0,
# triton 3.6.0, NumPy 2.5, mpi4py): once as the image has MPI, once with mpi4py finding no MPI
# library (MPI4PY_LIBMPI names none), as on an image without one.
#   bash scripts/gpu_rehearsal.sh                 # both runs; results in $OUT (out/gpu-rehearsal)
#   REHEARSAL_PYTHON=/path/to/python3.12 bash scripts/gpu_rehearsal.sh
# Its virtualenv ($REHEARSAL_VENV, default .rehearsal-venv) is made on the first run, from the
# package registry. Exit status 0 when both runs had no failed stage and no failed stand-in.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${REHEARSAL_VENV:-$root/.rehearsal-venv}"
python="${REHEARSAL_PYTHON:-python3.12}"
out="${OUT:-$root/out/gpu-rehearsal}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "torch==2.11.0" "triton==3.6.0" "numpy==2.5.*" mpi4py sentencepiece sacrebleu
fi
status=0
echo "[gpu-rehearsal] with the MPI library -> $out/with-mpi"
GPU_CHECK_PYTHON="$venv/bin/python" OUT="$out/with-mpi" \
  bash "$root/scripts/gpu_check.sh" --rehearse "$@" || status=1
echo "[gpu-rehearsal] without an MPI library -> $out/no-mpi"
MPI4PY_LIBMPI=/nonexistent/libmpi.so GPU_CHECK_PYTHON="$venv/bin/python" OUT="$out/no-mpi" \
  bash "$root/scripts/gpu_check.sh" --rehearse "$@" || status=1
exit $status
