"""Deadlines watched by a native thread end a process whose Python threads are all frozen (a
call that blocks while holding the GIL), with the message; a block that returns in time
disarms its deadline and the process goes on."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from commopt.comm import deadline
from tests.multirank import REPO, _base_env

FROZEN = r"""
import ctypes, sys, threading, time
from commopt.comm.deadline import deadline
ticks = []
threading.Thread(target=lambda: [ticks.append(time.sleep(0.1)) for _ in range(1000)], daemon=True).start()
with deadline(1.0, "commopt: rank 0: frozen for 1 s\n"):
    ctypes.PyDLL(None).sleep(30)  # libc sleep() with the GIL held: no Python thread runs
print("unreachable", flush=True)
"""

SURVIVES = r"""
import time
from commopt.comm.deadline import armed, deadline
for _ in range(3):
    with deadline(0.5, "should not be written\n"):
        time.sleep(0.1)
assert armed() == 0, armed()
time.sleep(1.0)  # past every deadline armed above
print("went on", flush=True)
"""


def _run(code: str) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=_base_env(None),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, time.monotonic() - t


@pytest.mark.skipif(deadline.native() is None, reason="commopt_ext._deadline is not built")
def test_a_frozen_process_ends_at_its_deadline_with_the_message():
    proc, seconds = _run(FROZEN)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "commopt: rank 0: frozen for 1 s" in proc.stderr, proc.stderr
    assert "unreachable" not in proc.stdout
    assert seconds < 20, f"ended after {seconds:.1f} s; the call alone sleeps 30 s"


def test_a_block_that_returns_in_time_disarms_its_deadline():
    proc, _ = _run(SURVIVES)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "went on"
    assert "should not be written" not in proc.stderr


def test_an_unbounded_deadline_arms_nothing():
    with deadline.deadline(float("inf"), "never"):
        assert deadline.armed() == 0
