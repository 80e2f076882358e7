"""commopt.bench.harness: timing, result files and rank jobs (real processes) behave as said."""

from __future__ import annotations

import json
import sys

import pytest

from commopt.bench import harness
from tests.multirank import needs_mpirun


def test_time_calls_warms_up_then_times_each_repeat():
    calls = []
    times = harness.time_calls(lambda: calls.append(1), repeats=3, warmup=2, calls=4)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert len(calls) == 2 + 3 * 4


def test_time_calls_refuses_no_repeats():
    with pytest.raises(ValueError, match="repeats >= 1"):
        harness.time_calls(lambda: None, repeats=0)


def test_interleaved_best_times_every_call():
    seen = []
    best = harness.interleaved_best(
        {"a": lambda: seen.append("a"), "b": lambda: seen.append("b")}, 2
    )
    assert set(best) == {"a", "b"}
    assert seen == ["a", "b"] * 3  # one warm-up each, then alternating


def test_command_line_is_relative_to_the_repository_and_quoted():
    line = harness.command_line(harness.REPO / "benchmarks" / "x.py", ["--out", "a b.json"])
    assert line == "python benchmarks/x.py --out 'a b.json'"


def test_append_run_keeps_earlier_runs(tmp_path):
    out = tmp_path / "sub" / "runs.json"
    harness.append_run(out, {"seed": 0})
    harness.append_run(out, {"seed": 1})
    assert json.loads(out.read_text()) == {"runs": [{"seed": 0}, {"seed": 1}]}
    assert out.read_text().endswith("\n")


def test_record_opens_with_the_run_facts_and_keeps_fields_last():
    doc = harness.record("benchmarks/x.py", ["-n", "2"], load_average=[1.0], size=4)
    assert list(doc)[:4] == ["command", "date", "machine", "load_average"]
    assert doc["command"] == "python benchmarks/x.py -n 2"
    assert doc["load_average"] == [1.0] and doc["size"] == 4
    assert "cores" in doc["machine"]


def test_launch_runs_every_rank_and_reports_a_failure():
    code = "import os; print('rank', os.environ['RANK'])"
    proc = harness.launch(2, [sys.executable, "-c", code], launcher="torch", timeout=60)
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]
    failing = "import sys; print('bad input', file=sys.stderr); sys.exit(3)"
    with pytest.raises(harness.RankJobFailed, match="bad input"):
        harness.launch(2, [sys.executable, "-c", failing], launcher="torch", timeout=60)


@needs_mpirun
def test_mpirun_reports_a_failing_job_with_its_stderr():
    failing = "import sys; print('rank failed', file=sys.stderr); sys.exit(3)"
    with pytest.raises(harness.RankJobFailed, match=r"(?s)mpirun: exit status \d+.*rank failed"):
        harness.mpirun(2, [sys.executable, "-c", failing], timeout=60)
