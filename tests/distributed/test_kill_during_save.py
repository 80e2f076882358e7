"""A rank SIGKILLed at a random moment of a checkpoint save: the previous checkpoint loads.

A short run of benchmarks/kill_during_save.py (the full one runs 100 trials): 2 gloo ranks
save back to back, one is killed after a random delay, the others right after; new ranks
resume with ``CheckpointManager.load_latest`` and compare what they restored with what was
saved for that step.
"""

import json
import subprocess

import pytest

from tests.multirank import PYTHON, REPO, launcher_free_env

pytestmark = pytest.mark.distributed


def test_killed_saves_leave_a_loadable_previous_checkpoint(tmp_path):
    out = tmp_path / "kill.json"
    env = launcher_free_env()
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [
            PYTHON,
            "benchmarks/kill_during_save.py",
            "--trials",
            "3",
            "--seed",
            "7",
            "--out",
            str(out),
        ],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.exists(), (
        f"the benchmark wrote no record ({proc.returncode}):\n{proc.stderr[-3000:]}"
    )
    summary = json.loads(out.read_text())["summary"]
    assert summary["trials"] == 3
    assert summary["loadable"] == 3, proc.stdout
    assert summary["wrong_resumes"] == 0, proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
