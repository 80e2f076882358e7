"""The rank runners' own contract: a hung job is ended by its runner, before pytest's per-test
timeout, and every rank's stacks are in the failure (tests/multirank.py)."""

import re
from pathlib import Path

import pytest

from tests import multirank
from tests.multirank import RUNNER_MARGIN_S, run_mpi, run_torch, runner_timeout

HANGS = """
import os, sys, time
print(f"pid {os.getpid()}", file=sys.stderr, flush=True)
def wait_here_forever():
    time.sleep(600)
wait_here_forever()
"""


@pytest.mark.timeout(60)
def test_a_runner_ends_before_the_tests_own_timeout():
    bound = runner_timeout(300)
    assert 60 - RUNNER_MARGIN_S - 5 < bound <= 60 - RUNNER_MARGIN_S, bound
    assert runner_timeout(10) == 10


def test_without_a_test_timeout_the_runner_keeps_its_own():
    multirank.set_test_timeout(None)  # for the rest of this test
    assert runner_timeout(300) == 300


@pytest.mark.parametrize("runner", [run_torch, run_mpi], ids=["torch", "mpi"])
def test_a_hung_job_reports_every_ranks_stacks(runner):
    with pytest.raises(AssertionError) as failed:
        runner(HANGS, 2, timeout=6)
    msg = str(failed.value)
    for rank in (0, 1):
        part = msg.split(f"--- rank {rank}: ", 1)[1].split("--- rank ", 1)[0]
        assert part.startswith("timed out after 6s"), msg
        assert "in wait_here_forever" in part, f"rank {rank} printed no stack:\n{msg}"
    # Every rank is gone (mpirun's ranks run in process groups of their own).
    for pid in re.findall(r"^pid (\d+)$", msg, re.M):
        stat = Path(f"/proc/{pid}/stat")
        alive = stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        assert not alive, f"rank process {pid} outlived its timed-out job:\n{msg}"
