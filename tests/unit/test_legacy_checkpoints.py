"""Checkpoints written by an earlier commopt load as what they were, and continue bit for bit.

The files in ``tests/unit/legacy_checkpoints/`` were written by commopt before the schedule
registry (see ``tests/unit/legacy_checkpoints.py``): a one-plan optimizer's flat state, two
plans, a pending double-buffered reduction with error feedback, compensated double buffering
between steps, and a ``save_checkpoint`` directory. The check runs in a process of its own
with pinned numerics, so the recorded weights compare exactly on any x86-64 CPU.
"""

import os
import subprocess
import sys
from pathlib import Path

from tests.unit.optimizer_sequences import PINNED_NUMERICS

ROOT = Path(__file__).resolve().parents[2]


def test_legacy_checkpoints_load_and_continue_as_recorded():
    env = {**os.environ, **PINNED_NUMERICS, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.legacy_checkpoints", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "every legacy checkpoint loaded as recorded" in done.stdout
