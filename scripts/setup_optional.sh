#!/usr/bin/env bash
# Optional parts of the set-up, called by scripts/setup.sh with the virtualenv path:
#
#   bash scripts/setup_optional.sh .venv
#
# Each part is tried on its own and never fails the set-up: when one cannot be built here,
# a warning says what is missing and how to retry; the tests that need it are skipped with
# that reason. Set COMMOPT_SKIP_OPTIONAL=1 to skip them all.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${VENV:-.venv}}

warn() { printf '\033[1;33m[setup] warning:\033[0m %s\n' "$*" >&2; }

if [ "${COMMOPT_SKIP_OPTIONAL:-0}" = 1 ]; then
  exit 0
fi

# Horovod (horovod.torch over MPI): the `horovod` communicator, compression adapters and
# tests/distributed/test_horovod.py.
if [ "${COMMOPT_SKIP_HOROVOD:-0}" = 1 ]; then
  warn "Horovod skipped (COMMOPT_SKIP_HOROVOD=1)"
elif ! bash scripts/build_horovod.sh "$VENV"; then
  warn "Horovod could not be built or installed; the Horovod communicator and its tests are" \
       "unavailable. See .horovod/build.log, fix the cause and run 'make horovod' to retry."
fi
exit 0
