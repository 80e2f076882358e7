"""`commopt bench step` end to end: real 2-rank jobs (DDP and commopt), one after the other.

A short run on plain loopback (the emulated link needs root and is exercised by the
benchmark itself): the 1-rank baseline, DDP fp32 and commopt 4-bit QSGD with error feedback
and double buffering on a tiny model. Checks the table's figures come from real timings
(positive, consistent with one another) and that the ranks ended with the same parameters.
"""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--models", "tiny", "--configs", "single,ddp-fp32,commopt-qsgd4+ef-db", "--no-link",
        "--steps", "3", "--warmup", "2", "--timeout", "150"]


def _cli_has_step() -> bool:
    """True once commopt/commands/bench.py runs benchmarks/step_bench.py as `bench step`."""
    try:
        bench = importlib.import_module("commopt.commands.bench")
    except ModuleNotFoundError:
        return False
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    try:
        args = parser.parse_args(["step", "--configs", "single"])
    except SystemExit:
        return False
    return getattr(args, "_bench", True) is not None


def test_bench_step_runs_ddp_and_commopt_side_by_side(tmp_path):
    out = tmp_path / "step.json"
    if _cli_has_step():
        cmd = [sys.executable, "-m", "commopt", "bench", "step", *ARGS, "--json", str(out)]
    else:  # until `commopt bench step` is wired in commopt/commands/bench.py: the same code
        cmd = [sys.executable, str(REPO / "benchmarks" / "step_bench.py"), *ARGS, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(REPO))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "plain loopback" in proc.stdout  # says what link it ran on
    report = json.loads(out.read_text())
    info = report["models"]["tiny"]
    rows = {r["config"]: r for r in info["rows"]}
    assert list(rows) == ["single", "ddp-fp32", "commopt-qsgd4+ef-db"]
    for name, row in rows.items():
        assert row["error"] is None, (name, row["error"])
        assert row["step_s"] > 0 and row["samples_per_s"] > 0, name
        assert row["final_loss"] == row["final_loss"] and row["final_loss"] < 5, name  # finite
    assert rows["ddp-fp32"]["speedup"] == pytest.approx(1.0)
    assert rows["single"]["efficiency"] == pytest.approx(1.0)
    q = rows["commopt-qsgd4+ef-db"]
    assert q["speedup"] == pytest.approx(rows["ddp-fp32"]["step_s"] / q["step_s"])
    assert q["efficiency"] == pytest.approx(rows["single"]["step_s"] / q["step_s"])
    # Both ranks trained the same parameters; they ran on their own ranks of a 2-rank job.
    for name in ("ddp-fp32", "commopt-qsgd4+ef-db"):
        raw = info["raw"][name]
        assert raw["size"] == 2 and raw["ranks_agree"] is True, name
        assert len(raw["step_times"]) == 3 and len(raw["losses"]) == 5, name
    # 4-bit QSGD puts far fewer bytes on the wire than fp32 (wire sizes from the buckets).
    assert q["wire_bytes"] < 0.5 * rows["ddp-fp32"]["wire_bytes"]
    assert "ddp-fp32" in proc.stdout and "speed-up" in proc.stdout
