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
exec "$python" -m commopt.gpu_check --out "$out" "$@"
