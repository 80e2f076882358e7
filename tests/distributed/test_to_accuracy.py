"""`commopt bench to_accuracy` end to end on plain loopback: 2 real ranks, 3 steps of a small MLP."""

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
        "--configs",
        "ddp-fp32,commopt-qsgd4+ef-db",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert rows["ddp-fp32"]["reached"] and rows["ddp-fp32"]["steps_to_target"] == 3
    for name, run in report["runs"].items():
        assert [p[0] for p in run["curve"]] == [0, 1, 2, 3], name
        assert run["curve"][-1][2] < run["curve"][0][2], name  # it learned something
        assert len(run["step_times"]) == 3 and all(t > 0 for t in run["step_times"]), name
