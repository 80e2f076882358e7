"""The communication timeout's settings, per-peer clocks, bounded waits and launcher export."""

from __future__ import annotations

import math
import re
import sys
import time

import pytest

import commopt
from commopt.comm.nccl import nccl_unavailable_reason
from commopt.comm.streams import StreamWork, synchronize_bounded
from commopt.comm.timeout import COMM_TIMEOUT_ENV, ProgressWatch, comm_timeout
from commopt.testbed.mpirun import export_flags


def test_the_timeout_comes_from_the_argument_then_the_environment_then_the_default():
    assert comm_timeout(environ={}) == 600.0
    assert comm_timeout(environ={COMM_TIMEOUT_ENV: "5"}) == 5.0
    assert comm_timeout(12, environ={COMM_TIMEOUT_ENV: "5"}) == 12.0
    for off in ("0", "off", "inf", "none"):
        assert math.isinf(comm_timeout(off, environ={}))


@pytest.mark.parametrize("bad", ["-3", "soon", "nan"])
def test_a_bad_timeout_names_the_setting_and_the_fix(bad):
    with pytest.raises(ValueError, match=f"{COMM_TIMEOUT_ENV}=.*give the seconds"):
        comm_timeout(environ={COMM_TIMEOUT_ENV: bad})
    with pytest.raises(ValueError, match="timeout="):
        commopt.create_communicator("local", timeout=bad)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_peer_has_its_own_clock_and_progress_restarts_it():
    clock = Clock()
    w = ProgressWatch(5.0, rank=0, clock=clock)
    w.begin("alltoall (pipelined) of 64 bytes", [1, 2, 3])
    clock.now += 4
    w.heard(1)  # bytes from rank 1: its clock restarts
    w.settle(3)  # rank 3 owes nothing more
    clock.now += 4
    assert w.stalled() == [2]
    msg = w.message()
    assert "rank 0: alltoall (pipelined) of 64 bytes made no progress for 5s" in msg
    assert "nothing from rank 2 for 8.0s" in msg and "rank 1" not in msg
    clock.now += 2
    assert w.stalled() == [1, 2]
    w.end()
    clock.now += 100
    assert w.stalled() == []  # no collective in flight: nothing to time


def test_a_slow_peer_that_keeps_sending_never_stalls():
    clock = Clock()
    w = ProgressWatch(5.0, rank=1, clock=clock)
    w.begin("allreduce", [0])
    for _ in range(100):  # 100 segments 4 s apart: 400 s in all, never 5 s of silence
        clock.now += 4
        assert w.stalled() == []
        w.heard(0)


class _Streams:
    """Events that complete after ``done_after`` polls (never, for None)."""

    def __init__(self, done_after=None):
        self.done_after, self.polls, self.synchronized = done_after, 0, False

    def query(self, event) -> bool:
        self.polls += 1
        return self.done_after is not None and self.polls > self.done_after

    def synchronize(self, event) -> None:
        self.synchronized = True

    def current(self, device):
        return "caller"


def test_a_bounded_host_wait_gives_up_and_polls_the_error_check():
    streams = _Streams(done_after=None)
    work = StreamWork(streams, "e1", None, "comm")
    t = time.monotonic()
    assert synchronize_bounded(work, 0.2) is False
    assert 0.2 <= time.monotonic() - t < 2 and not streams.synchronized

    def check():
        raise RuntimeError("NCCL error: remote process exited")

    with pytest.raises(RuntimeError, match="remote process exited"):
        synchronize_bounded(StreamWork(_Streams(), "e2", None, "comm"), 5.0, check)
    done = _Streams(done_after=3)
    assert synchronize_bounded(StreamWork(done, "e3", None, "comm"), 5.0) and done.synchronized


def test_missing_nccl_names_the_package_pyproject_installs():
    reason = nccl_unavailable_reason()
    if reason is None:
        pytest.skip("CuPy with NCCL is installed here")
    assert "cupy-cuda13x" in reason or "nvidia-nccl-cu13" in reason, reason


def test_mpirun_hands_every_rank_the_commopt_variables():
    env = {"COMMOPT_COMM_TIMEOUT": "5", "COMMOPT_NODE_NAME": "n0", "HOROVOD_X": "1", "PATH": "/"}
    assert export_flags(env) == ["-x", "COMMOPT_COMM_TIMEOUT", "-x", "HOROVOD_X"]


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["mpi", "torch"])
def test_commopt_launch_hands_the_timeout_to_every_rank(launcher, monkeypatch):
    from tests.multirank import launch, mpirun_available

    if launcher == "mpi" and not mpirun_available():
        pytest.skip("mpirun not found: install Open MPI")
    monkeypatch.setenv(COMM_TIMEOUT_ENV, "7")
    show = "import os; print('timeout=' + os.environ.get('COMMOPT_COMM_TIMEOUT', '-'), flush=True)"
    r = launch("-n", "2", "--launcher", launcher, "--", sys.executable, "-c", show, timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.findall(r"timeout=(\S)", r.stdout) == ["7", "7"], r.stdout  # lines may interleave
