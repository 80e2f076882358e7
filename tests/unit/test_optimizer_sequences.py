"""The optimizer's behaviour is unchanged: recorded random call sequences replay identically.

``tests/unit/optimizer_sequences.json`` holds, for random sequences of optimizer calls in
every mode (synchronous with and without overlap, double-buffered, compensated; zero_fill;
codecs; clipping; SGD and Adam), a digest after every call of the weights, the gradients,
the exception raised (type and message) and the counters. Any change in behaviour shows up
as the first call whose digest differs, printed in full.

Each quarter replays in a process of its own with pinned numerics (see
``tests/unit/optimizer_sequences.py``), so the float bits do not depend on the CPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.optimizer_sequences import FIXTURE, PINNED_NUMERICS

ROOT = Path(__file__).resolve().parents[2]

RECORDED = json.loads(FIXTURE.read_text())


def test_the_fixture_covers_every_schedule_and_raises_somewhere():
    modes = {str(r["mode"]["double_buffering"]) for r in RECORDED["runs"]}
    assert modes == {"False", "True", "compensated"}
    kinds = {k for r in RECORDED["runs"] for k in r["errors"]}
    assert sum(sum(r["errors"].values()) for r in RECORDED["runs"]) > 100  # error paths too
    # Only the errors that name the fix (and torch's own, from GradScaler misuse).
    assert kinds <= {"RuntimeError", "ValueError", "AssertionError"}, kinds


@pytest.mark.parametrize("chunk", range(4))
def test_recorded_sequences_replay_identically(chunk):
    env = {**os.environ, **PINNED_NUMERICS, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.optimizer_sequences", "--replay", str(chunk)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "replayed identically" in done.stdout
