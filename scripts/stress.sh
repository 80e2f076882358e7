#!/usr/bin/env bash
# The multi-rank tests N times in a row under a CPU hog, on two pytest workers as CI runs them;
# at the end, every test that failed in any run, how often, and each failure's text (the
# rank runners in tests/multirank.py put every rank's stacks in it when a job hangs).
#
#   bash scripts/stress.sh                 # N=10 runs of the default set, a hog on every core
#   N=3 bash scripts/stress.sh             # three runs
#   HOG=0 bash scripts/stress.sh           # no hog (the machine's own load only)
#   bash scripts/stress.sh tests/distributed/test_horovod.py -k leave   # other tests / pytest args
#
# `make stress` runs it (STRESS_N=, STRESS_ARGS=). Results: $OUT (default out/stress): run-<i>.xml
# (JUnit), run-<i>.log (pytest's output), runs.tsv (exit code, seconds, load average of each run),
# stress.json (scripts/stress_report.py's record) and summary.txt. Exit 0 only when every run
# passed. Record a result in docs/reliability.md:
#   python scripts/stress_report.py --from-json out/stress/stress.json --docs docs/reliability.md
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-$root/.venv/bin/python}"
n="${N:-10}"
hog="${HOG:-1}"
workers="${WORKERS:--n 2 --dist loadfile}"
out="${OUT:-$root/out/stress}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# The multi-rank tests whose races cost CI runs: the fault matrix, Horovod, launch, resource
# release, elastic restart, per-group plans and the optimizer on real ranks.
default_tests=(
  tests/distributed/test_fault_matrix.py
  tests/distributed/test_horovod.py
  tests/distributed/test_launch_local.py
  tests/distributed/test_optimizer_release.py
  tests/distributed/test_topology_release.py
  tests/distributed/test_elastic_restart.py
  tests/distributed/test_per_group_plans.py
  tests/distributed/test_multi_node_optimizer.py
)
if [ "$#" -gt 0 ]; then args=("$@"); else args=("${default_tests[@]}"); fi

mkdir -p "$out"
rm -f "$out"/run-*.xml "$out"/run-*.log "$out"/summary.txt "$out"/runs.tsv "$out"/stress.json

hogs=()
hogs_started=()
stop_hogs() {
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
  hogs=()
}
trap 'stop_hogs; exit 130' INT TERM
trap stop_hogs EXIT
if [ "$hog" != "0" ]; then
  cores=$(nproc)
  for _ in $(seq "$cores"); do
    bash -c 'while :; do :; done' &
    hogs+=("$!")
  done
  hogs_started=("${hogs[@]}")
  echo "[stress] CPU hog: $cores busy processes (pids ${hogs[*]})"
fi

start=$(date +%s)
started=$(date -u '+%Y-%m-%d %H:%M UTC')
echo "[stress] $n runs of: $python -m pytest -q -p no:cacheprovider $workers ${args[*]}"
echo "[stress] started $started, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq "$n"); do
  t0=$(date +%s)
  # shellcheck disable=SC2086  # $workers is a list of options
  "$python" -m pytest -q -p no:cacheprovider $workers --junitxml="$out/run-$i.xml" \
    "${args[@]}" >"$out/run-$i.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - t0 ))
  printf '%s\t%s\t%s\t%s\n' "$i" "$rc" "$took" "$(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/runs.tsv"
  echo "[stress] run $i/$n: exit $rc, $took s, $(tail -n 1 "$out/run-$i.log")"
done
stop_hogs
echo "[stress] $n runs in $(( $(date +%s) - start )) s, load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%s\n' "${args[@]}" >"$out/args.txt"
quoted="$(printf ' %q' "$@")"  # the command as it can be typed again
STRESS_COMMAND="N=$n HOG=$hog bash scripts/stress.sh${*:+$quoted}" STRESS_STARTED="$started" \
  STRESS_HOG="${#hogs_started[@]}" STRESS_WORKERS="$workers" \
  STRESS_COMMIT="$(git -C "$root" rev-parse --short HEAD 2>/dev/null)" \
  "$python" "$root/scripts/stress_report.py" "$out" --json "$out/stress.json" | tee "$out/summary.txt"
