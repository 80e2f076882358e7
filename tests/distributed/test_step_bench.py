"""`commopt bench step` end to end: real 2-rank jobs running DDP and commopt in turn.

A short run on plain loopback (the emulated link needs root and is exercised by the
benchmark itself) on a tiny model: DDP fp32, commopt fp16 and commopt 4-bit QSGD with error
feedback and double buffering, two rounds of 2 blocks (2 + 1 timed steps, each followed by
compute-only steps). commopt fp16 has a
failure injected on its last rank: the driver must report it and finish the others in a
restarted job. Checks that the table's figures come from real timings and agree with one
another, and that the ranks ended with the same parameters.
"""
import importlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["ddp-fp32", "commopt-fp16", "commopt-qsgd4+ef-db"]
ARGS = ["--models", "tiny", "--configs", ",".join(CONFIGS), "--no-link", "--rounds", "2",
        "--steps", "3", "--block", "2", "--warmup", "2", "--timeout", "300", "--collective-timeout", "60"]


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
        args, unknown = parser.parse_known_args(["step", "--configs", "ddp-fp32"])
    except SystemExit:
        return False
    return not unknown and getattr(args, "_bench", True) is not None


def test_bench_step_runs_ddp_and_commopt_side_by_side(tmp_path):
    out = tmp_path / "step.json"
    if _cli_has_step():
        cmd = [sys.executable, "-m", "commopt", "bench", "step", *ARGS, "--json", str(out)]
    else:  # until `commopt bench step` is wired in commopt/commands/bench.py: the same code
        cmd = [sys.executable, str(REPO / "benchmarks" / "step_bench.py"), *ARGS, "--json", str(out)]
    env = {**__import__("os").environ, "COMMOPT_STEP_BENCH_FAIL": "commopt-fp16"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(REPO), env=env)
    log = f"{' '.join(cmd)}:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    # The injected failure makes the run fail, after every other configuration finished.
    assert proc.returncode == 1, log
    assert "failed: tiny/commopt-fp16" in proc.stderr, log
    assert "plain loopback" in proc.stdout, log  # says what link it ran on
    report = json.loads(out.read_text())
    info = report["models"]["tiny"]
    rows = {r["config"]: r for r in info["rows"]}
    assert list(rows) == CONFIGS
    assert "failure injected into commopt-fp16" in rows["commopt-fp16"]["error"]
    for name in ("ddp-fp32", "commopt-qsgd4+ef-db"):
        row = rows[name]
        assert row["error"] is None, (name, row["error"])
        assert row["step_s"] > 0 and row["compute_s"] > 0 and row["samples_per_s"] > 0, name
        blocks = [e for rnd in info["raw"][name]["rounds"] for e in rnd["block_efficiency"]]
        assert len(blocks) == 4 and row["efficiency"] == pytest.approx(statistics.median(blocks)), name
        assert row["final_loss"] == row["final_loss"] and row["final_loss"] < 5, name  # finite
        assert len(info["raw"][name]["rounds"]) == 2, name  # both rounds, across the restart
    assert rows["ddp-fp32"]["speedup"] == pytest.approx(1.0)
    q = rows["commopt-qsgd4+ef-db"]
    assert q["speedup"] == pytest.approx(rows["ddp-fp32"]["step_s"] / q["step_s"])
    assert q["samples_per_s"] == pytest.approx(2 * 16 / q["step_s"])
    # Both ranks trained the same parameters, each as its own rank of a 2-rank job.
    for name in ("ddp-fp32", "commopt-qsgd4+ef-db"):
        raw = info["raw"][name]
        assert raw["size"] == 2 and raw["ranks_agree"] is True, name
        for rnd in raw["rounds"]:
            assert len(rnd["step_times"]) == 3 and len(rnd["compute_times"]) == 3, name
            # 2 warm-up + 3 timed steps, and an untimed restart after the pause
            assert len(rnd["losses"]) == 6, name
            assert len(rnd["rank_step_medians"]) == 2, name
    # The same seed and data every round: DDP's training is the same each time.
    d = info["raw"]["ddp-fp32"]["rounds"]
    assert d[0]["losses"] == pytest.approx(d[1]["losses"], rel=1e-5)
    # 4-bit QSGD puts far fewer bytes on the wire than fp32 (wire sizes from the buckets).
    assert q["wire_bytes"] < 0.5 * rows["ddp-fp32"]["wire_bytes"]
    assert "speed-up" in proc.stdout and "restarting the job without commopt-fp16" in proc.stdout
