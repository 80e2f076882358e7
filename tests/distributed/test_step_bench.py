"""`commopt bench step` end to end: real 2-rank jobs running DDP and commopt in turn.

A short run on plain loopback (the emulated link needs root and is exercised by the
benchmark itself) on a tiny model: DDP fp32, commopt fp16 and commopt 4-bit QSGD with error
feedback and double buffering, two rounds of 2 blocks (2 + 1 timed steps, each followed by
compute-only steps). commopt fp16 has a
failure injected on its last rank: the driver must report it and finish the others in a
restarted job. Checks that the table's figures come from real timings and agree with one
another, and that the ranks ended with the same parameters.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["ddp-fp32", "commopt-fp16", "commopt-qsgd4+ef-db"]
ARGS = [
    "--models",
    "tiny",
    "--configs",
    ",".join(CONFIGS),
    "--no-link",
    "--rounds",
    "2",
    "--steps",
    "3",
    "--block",
    "2",
    "--warmup",
    "2",
    "--timeout",
    "300",
    "--collective-timeout",
    "60",
]


def test_bench_step_runs_ddp_and_commopt_side_by_side(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, "-m", "commopt", "bench", "step", *ARGS, "--json", str(out)]
    env = {**os.environ, "COMMOPT_STEP_BENCH_FAIL": "commopt-fp16"}
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
        assert len(blocks) == 4 and row["efficiency"] == pytest.approx(statistics.median(blocks)), (
            name
        )
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


def _package_only(tmp_path):
    """A copy of the package alone (commopt, commopt_ext: what `pip install .` installs), and a
    working directory beside it: nothing of the checkout (benchmarks/, tests/) is reachable."""
    site, cwd = tmp_path / "site", tmp_path / "elsewhere"
    for pkg in ("commopt", "commopt_ext"):
        shutil.copytree(REPO / pkg, site / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "COMMOPT_STEP_BENCH_FAIL"}
    env["PYTHONPATH"] = str(site)
    return site, cwd, env


def test_bench_step_runs_from_the_package_alone(tmp_path):
    """`commopt bench step` needs nothing of the checkout: --help, then a real 2-rank run."""
    site, cwd, env = _package_only(tmp_path)
    help_ = subprocess.run(
        [sys.executable, "-m", "commopt", "bench", "step", "--help"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert help_.returncode == 0, help_.stderr
    assert "--sim-measurements" in help_.stdout and "ddp-powersgd1" in help_.stdout
    out = cwd / "step.json"
    cmd = [
        sys.executable,
        "-m",
        "commopt",
        "bench",
        "step",
        "--models",
        "tiny",
        "--configs",
        "ddp-fp32,commopt-qsgd4",
        "--no-link",
        "--rounds",
        "1",
        "--steps",
        "2",
        "--block",
        "2",
        "--warmup",
        "1",
        "--timeout",
        "240",
        "--collective-timeout",
        "60",
        "--json",
        str(out),
        "--markdown",
        str(cwd / "step.md"),
    ]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    log = f"{' '.join(cmd)}:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, log
    report = json.loads(out.read_text())
    assert report["command"].startswith("commopt bench step --models tiny"), report["command"]
    rows = {r["config"]: r for r in report["models"]["tiny"]["rows"]}
    assert list(rows) == ["ddp-fp32", "commopt-qsgd4"], log
    for name, row in rows.items():
        assert row["error"] is None and row["step_s"] > 0 and row["ranks_agree"] is True, (
            name,
            log,
        )
    # What the driver and its ranks import in this environment is the copy, not the checkout.
    where = subprocess.run(
        [sys.executable, "-c", "import commopt.bench.step as s; print(s.__file__)"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.strip().startswith(str(site)), where
    assert "| commopt-qsgd4" in (cwd / "step.md").read_text()
