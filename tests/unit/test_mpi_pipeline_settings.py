"""Choosing and sizing the mpi communicator's pipelined transfers (no MPI started here)."""

import pytest

pytest.importorskip("mpi4py")

from commopt.comm.mpi import (
    DEFAULT_PIPELINE_MIN_BYTES,
    default_segment_bytes,
    pipeline_settings,
    transfer_path,
)
from commopt.comm.mpi.p2p import _block_bounds, _segments
from commopt.testbed.mpirun import TCP_EAGER_LIMIT, mpirun_local_argv, tcp_mca_defaults


def test_segments_fit_under_the_eager_limit_mpirun_passes():
    assert default_segment_bytes({}) == 60 * 1024  # Open MPI's default limit is 64 KiB
    seg = default_segment_bytes({"OMPI_MCA_btl_tcp_eager_limit": str(TCP_EAGER_LIMIT)})
    assert TCP_EAGER_LIMIT - 4096 <= seg < TCP_EAGER_LIMIT and seg % 4096 == 0
    with pytest.raises(ValueError, match="number of bytes"):
        default_segment_bytes({"OMPI_MCA_btl_tcp_eager_limit": "lots"})


def test_settings_from_options_then_environment():
    env = {
        "COMMOPT_MPI_PIPELINE": "0",
        "COMMOPT_MPI_SEGMENT_BYTES": "128K",
        "COMMOPT_MPI_PIPELINE_MIN_BYTES": "2M",
    }
    assert pipeline_settings(environ=env) == ("off", 128 * 1024, 2 << 20)
    assert pipeline_settings(True, 4096, 0, environ=env) == ("on", 4096, 0)
    assert pipeline_settings(environ={})[0] == "auto"
    assert pipeline_settings(environ={})[2] == DEFAULT_PIPELINE_MIN_BYTES
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        pipeline_settings("sometimes", environ={})
    with pytest.raises(ValueError, match="too small"):
        pipeline_settings("on", 4, environ={})


def test_auto_pipelines_large_buffers_between_nodes_and_polls_small_ones():
    big, small = 64 << 20, 1024
    kw = dict(min_bytes=256 << 10)
    assert transfer_path("auto", big, size=2, inter_size=2, **kw) == "pipelined"
    assert transfer_path("auto", small, size=2, inter_size=2, **kw) == "polled"
    assert transfer_path("auto", big, size=4, inter_size=1, **kw) == "blocking"  # one node
    assert transfer_path("on", big, size=2, inter_size=1, **kw) == "pipelined"
    assert transfer_path("on", small, size=2, inter_size=1, **kw) == "polled"
    assert transfer_path("off", big, size=2, inter_size=2, **kw) == "blocking"
    assert transfer_path("on", big, size=1, inter_size=1, **kw) == "blocking"  # a world of one


def test_blocks_and_segments_cover_every_element_once():
    for numel, parts, seg in ((10, 3, 2), (1, 4, 5), (1031, 4, 7), (8, 2, 8)):
        covered = [
            i
            for lo, hi in _block_bounds(numel, parts)
            for a, b in _segments(lo, hi, seg)
            for i in range(a, b)
        ]
        assert covered == list(range(numel))
        assert all(
            b - a <= seg
            for lo, hi in _block_bounds(numel, parts)
            for a, b in _segments(lo, hi, seg)
        )


def test_launch_passes_the_eager_limit_unless_the_environment_sets_one():
    argv = mpirun_local_argv(2, ["python", "t.py"], is_root=False, ncpus=2)
    i = argv.index("btl_tcp_eager_limit")
    assert argv[i + 1] == str(TCP_EAGER_LIMIT)
    j = argv.index("btl_tcp_rndv_eager_limit")
    assert argv[j + 1] == str(TCP_EAGER_LIMIT)
    assert tcp_mca_defaults({"OMPI_MCA_btl_tcp_rndv_eager_limit": "4096"}) == {}


def test_wait_mode_and_longest_sleep_from_the_environment():
    from commopt.comm.mpi.settings import wait_settings

    assert wait_settings({}) == ("paced", pytest.approx(200e-6))
    assert wait_settings({"COMMOPT_MPI_WAIT": "Polled", "COMMOPT_MPI_POLL_SLEEP_US": "50"}) == (
        "polled",
        pytest.approx(50e-6),
    )
    assert wait_settings({"COMMOPT_MPI_POLL_SLEEP_US": "0"})[0] == "spin"  # 0: MPI_Wait
    with pytest.raises(ValueError, match="COMMOPT_MPI_WAIT='busy': use one of paced, polled, spin"):
        wait_settings({"COMMOPT_MPI_WAIT": "busy"})
    for bad in ("fast", "-5", "1e9"):
        with pytest.raises(ValueError, match=r"COMMOPT_MPI_POLL_SLEEP_US.*microseconds"):
            wait_settings({"COMMOPT_MPI_POLL_SLEEP_US": bad})


class _Request:
    """Completes on the n-th Test (a stand-in for an MPI request's polling; not a transport test)."""

    def __init__(self, tests_to_complete: int):
        self.left = tests_to_complete

    def Test(self):
        self.left -= 1
        return self.left <= 0


def test_paced_wait_naps_through_the_expected_time_in_few_polls(monkeypatch):
    from commopt.comm.mpi import p2p

    monkeypatch.setattr(p2p, "_WAIT_MODE", "paced")
    naps, clock = [], [0.0]

    def sleep(s):  # a clock that moves only when the wait sleeps
        naps.append(s)
        clock[0] += s

    monkeypatch.setattr(p2p.time, "sleep", sleep)
    monkeypatch.setattr(p2p.time, "perf_counter", lambda: clock[0])
    # Completes on the 4th Test: the first Test, then naps of half of what is left, at most
    # _PACE_MAX_S (so that Open MPI refills the socket before it drains)...
    assert p2p.wait_polled(_Request(4), expect_s=0.008) == pytest.approx(3 * p2p._PACE_MAX_S)
    assert naps == pytest.approx([p2p._PACE_MAX_S] * 3)
    naps.clear()
    clock[0] = 0.0
    assert p2p.wait_polled(_Request(4), expect_s=0.0016) == pytest.approx(0.0014)
    assert naps == pytest.approx([0.0008, 0.0004, 0.0002])
    # Without an expectation: polls with doubling sleeps from 10 us.
    naps.clear()
    p2p.wait_polled(_Request(4), expect_s=0.0)
    assert naps == [10e-6, 20e-6]
