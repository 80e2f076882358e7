"""The intra/inter-node communicators of hierarchical reduction are freed with their parent."""

from tests.multirank import run_mpi

SCRIPT = r"""
import gc, os
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
os.environ["COMMOPT_NODE_NAME"] = f"n{rank // 2}"
import torch, commopt
from commopt import collectives
from commopt.comm.mpi.transport import live_mpi_communicators
world = commopt.create_communicator("mpi")
before = live_mpi_communicators()
for _ in range(3):
    comm = world.split(0, world.rank)
    collectives.allreduce(comm, torch.ones(1000), None, algorithm="hierarchical")
    comm.finalize()
    del comm
    gc.collect()
print(before, live_mpi_communicators())
"""


def test_hierarchy_pair_is_finalized_with_its_communicator():
    for rank, out in enumerate(run_mpi(SCRIPT, 4, timeout=120)):
        before, after = map(int, out.split()[-2:])
        assert after == before, f"rank {rank}: {after - before} MPI communicators left behind"
