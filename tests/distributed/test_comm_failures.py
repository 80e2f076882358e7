"""A rank that dies must end the job with an error on the others, never a hang."""
import pytest

from tests.multirank import run_mpi, run_torch

pytestmark = pytest.mark.distributed

DIES = """
import sys, time, torch, commopt
comm = commopt.create_communicator(sys.argv[1])
if comm.rank == 1:
    raise RuntimeError("rank 1 fails on purpose")
t = torch.ones(4)
comm.allreduce(t)   # rank 0 would wait here forever without the abort / closed socket
print("unreachable")
"""


def test_mpi_rank_failure_aborts_job_quickly():
    with pytest.raises(AssertionError) as info:
        run_mpi(DIES, 2, args=["mpi"], timeout=60)
    msg = str(info.value)
    assert "rank 1" in msg and "fails on purpose" in msg and "timed out" not in msg, msg


def test_gloo_rank_failure_raises_on_peer():
    with pytest.raises(AssertionError) as info:
        run_torch(DIES, 2, args=["torch"], timeout=90)
    msg = str(info.value)
    assert "fails on purpose" in msg and "timed out" not in msg, msg
