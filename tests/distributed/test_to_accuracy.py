"""`commopt bench to_accuracy` end to end on plain loopback: 2 real ranks, 2 seeds, a few steps
of a small MLP; DDP fp32 sets each seed's target, the others get up to twice its steps."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_to_accuracy_runs_ddp_and_commopt_to_the_target(tmp_path):
    out = tmp_path / "tta.json"
    cmd = [
        sys.executable,
        "-m",
        "commopt",
        "bench",
        "to_accuracy",
        "--no-link",
        "--budget",
        "3",
        "--eval-every",
        "1",
        "--hidden",
        "128",
        "--valid-windows",
        "32",
        "--timeout",
        "200",
        "--collective-timeout",
        "60",
        "--seeds",
        "0,1",
        "--budget-factor",
        "2",
        "--compute-steps",
        "2",
        "--configs",
        "ddp-fp32,ddp-powersgd4-warm,commopt-qsgd4+ef-db,commopt-qsgd4+ef-comp",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert rows["ddp-fp32"]["reached"] and rows["ddp-fp32"]["steps_to_target"] == 3
    assert rows["ddp-fp32"]["seeds_run"] == 2
    for name, run in report["runs"].items():
        assert sorted(run["seeds"]) == ["0", "1"], name
        for seed, rec in run["seeds"].items():
            steps = [p[0] for p in rec["curve"]]
            if name == "ddp-fp32":
                assert steps == [0, 1, 2, 3], (name, seed)
            else:  # up to 2 x 3 steps, stopping at the first evaluation at the target
                assert steps == list(range(len(steps))) and 1 < len(steps) <= 7, (name, seed)
                target = run["seeds"][seed]["stop_target"]
                assert (rec["curve"][-1][2] <= target) == (rec["stopped"] == "target"), name
                assert rec["stopped"] == "target" or steps[-1] == 6, (name, seed)
            assert rec["curve"][-1][2] < rec["curve"][0][2], (name, seed)  # it learned
            assert len(rec["step_times"]) == steps[-1], (name, seed)
            assert rec["compute_s"] > 0 and rec["codec_s"] >= 0, (name, seed)
    assert report["runs"]["ddp-powersgd4-warm"]["seeds"]["0"]["powersgd_start_iter"] == 2
    assert len(report["runs"]["commopt-qsgd4+ef-comp"]["seeds"]["0"]["plans"]) == 2
    # The header's check: DDP fp32's median step against its compute-only step, recorded.
    check = report["setting_check"]
    assert report["setting"] == "compute-heavy" and check["met"] is None
    assert check["ratio"] == pytest.approx(check["median_step_s"] / check["compute_s"])
    assert "DDP fp32: median step" in proc.stdout
