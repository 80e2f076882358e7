"""A communicator owns the intra/inter-node communicators its hierarchy split off: its
``finalize()`` frees their MPI communicators and stops their worker threads, on the calling
thread, with the garbage collector off and every object still referenced (4 real MPI ranks
on two fake nodes)."""

import json

from tests.multirank import run_mpi

SCRIPT = r"""
import gc, json, os, threading
gc.disable()  # nothing below may depend on the collector
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
os.environ["COMMOPT_NODE_NAME"] = f"n{rank // 2}"
import torch, commopt
from commopt import collectives
from commopt.comm import topology
from commopt.comm.errors import CommError
from commopt.comm.mpi.transport import live_mpi_communicators as live

def mpi_threads():
    return sum(t.name.startswith("commopt-mpi-") for t in threading.enumerate())

world = commopt.create_communicator("mpi")
out = {"start": [live(), mpi_threads()]}
kept = []
for i in range(3):
    comm = world.split(0, world.rank)
    buf = torch.full((1000,), float(world.rank))
    collectives.allreduce(comm, buf, None, algorithm="hierarchical")
    assert buf[0].item() == sum(range(world.size)) / world.size, buf[0].item()  # the mean
    intra, inter = topology.hierarchy(comm)
    assert (intra.size, inter.size) == (2, 2), (intra.size, inter.size)
    out.setdefault("in_use", [live(), mpi_threads()])
    comm.finalize()
    comm.finalize()  # twice is fine
    out["pair_finalized"] = [getattr(c, "finalized", None) for c in (intra, inter)]
    kept.append((comm, intra, inter))  # still referenced: only finalize() freed them
out["after_finalize"] = [live(), mpi_threads()]

# Through the optimizer: close() finalizes its private communicator, and with it the pair.
model = torch.nn.Linear(8, 4)
opt = commopt.create_multi_node_optimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), world, model=model, algorithm="hierarchical"
)
for _ in range(2):
    opt.zero_grad()
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
opt.close()
out["after_close"] = [live(), mpi_threads()]

try:
    topology.hierarchy(kept[0][0])
    out["hierarchy_after_finalize"] = "built"
except CommError as exc:
    out["hierarchy_after_finalize"] = str(exc)
world.finalize()
out["end"] = [live(), mpi_threads()]
print(json.dumps(out))
"""


def test_finalize_frees_the_hierarchy_split_off_a_communicator():
    outs = run_mpi(SCRIPT, 4, timeout=180)
    for rank, text in enumerate(outs):
        c = json.loads(text.strip().splitlines()[-1])
        comms = c["start"][0]
        assert c["in_use"][0] == comms + 3, f"rank {rank}: the split and its pair are live: {c}"
        assert c["after_finalize"] == c["start"], (
            f"rank {rank}: finalize() left MPI communicators or worker threads of the hierarchy "
            f"([MPI communicators, commopt-mpi threads]): {c}"
        )
        assert c["after_close"] == c["start"], f"rank {rank}: close() left some: {c}"
        assert c["pair_finalized"] == [True, True], f"rank {rank}: {c}"
        assert "finalized" in c["hierarchy_after_finalize"], f"rank {rank}: {c}"
        assert c["end"] == [0, 0], f"rank {rank}: the world's finalize() left some: {c}"


DROPPED = r"""
import gc, json, os, threading
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
os.environ["COMMOPT_NODE_NAME"] = f"n{rank // 2}"
import torch, commopt
from commopt.comm.mpi.transport import live_mpi_communicators as live

def mpi_threads():
    return sum(t.name.startswith("commopt-mpi-") for t in threading.enumerate())

world = commopt.create_communicator("mpi")
base = [live(), mpi_threads()]

def train(double_buffering):
    model = torch.nn.Linear(64, 64)
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), world, model=model,
        algorithm="hierarchical", double_buffering=double_buffering,
    )
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 64)).sum().backward()
        opt.step()  # double buffering: the last reduction is still in flight when dropped
    return [live(), mpi_threads()]

out = {"base": base}
for db in (False, True):
    out[f"in_use db={db}"] = [train(db) for _ in range(3)]  # each dropped at once
    gc.collect()
    model = torch.nn.Linear(4, 4)  # the next optimizer's creation and close release them
    commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), world, model=model
    ).close()
    out[f"left db={db}"] = [live() - base[0], mpi_threads() - base[1]]
world.finalize()
print(json.dumps(out))
"""


def test_dropped_hierarchical_optimizers_leave_no_mpi_communicator():
    """Three hierarchical optimizers dropped (without close(), the last ones with a reduction
    in flight): their private communicators and each one's intra/inter-node pair are finalized
    on the private communicator's own worker, after its reductions, by the next optimizer's
    creation or close (4 real MPI ranks on two fake nodes)."""
    outs = run_mpi(DROPPED, 4, timeout=240)
    for rank, text in enumerate(outs):
        c = json.loads(text.strip().splitlines()[-1])
        for db in (False, True):
            in_use = c[f"in_use db={db}"]
            assert all(comms > c["base"][0] + 2 for comms, _ in in_use), (
                f"rank {rank}: no private communicator and pair while training: {c}"
            )
            assert c[f"left db={db}"] == [0, 0], (
                f"rank {rank}: 3 dropped hierarchical optimizers (double_buffering={db}) left "
                f"[MPI communicators, commopt-mpi threads] = {c[f'left db={db}']}: {c}"
            )
