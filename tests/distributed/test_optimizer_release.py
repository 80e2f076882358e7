"""Optimizers release what they create: constructing N of them over the mpi communicator
grows neither the threads nor the MPI communicators (close() frees their private
communicator; dropping them queues it, and the next optimizer's creation, step or close frees
it), and finalize() leaves no worker thread (2 real MPI ranks)."""

import json

from tests.multirank import run_mpi

SCRIPT = r"""
import gc, json, threading, time, torch, commopt
from commopt.comm.mpi.transport import live_mpi_communicators as live

def census():
    # A dropped communicator's worker thread is told to stop when the communicator is
    # collected and exits a moment later: count once the count has settled (a thread that
    # never stops is still counted).
    gc.collect()
    count = threading.active_count()
    for _ in range(50):
        time.sleep(0.05)
        gc.collect()
        if threading.active_count() == count:
            break
        count = threading.active_count()
    return [count, live()]

comm = commopt.create_communicator("mpi")

def make():
    model = torch.nn.Linear(4, 2)
    opt = commopt.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                              model=model)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return opt

make().close()            # the first one starts what stays (the parent's worker)
base = census()
for _ in range(6):
    make().close()
closed = census()
for _ in range(6):
    make()                # dropped without close()
gc.collect()              # their finalizers queue their communicators, which the next
make().close()            # optimizer's creation, step or close releases
dropped = census()
sub = comm.split(comm.rank % 2)
sub.allreduce(torch.ones(3))
sub.finalize()
comm.finalize()
print(json.dumps({"base": base, "closed": closed, "dropped": dropped, "final": census()}))
"""


def test_n_optimizers_do_not_grow_threads_or_mpi_communicators():
    outs = run_mpi(SCRIPT, 2, timeout=180)
    for rank, out in enumerate(outs):
        c = json.loads(out.strip().splitlines()[-1])
        assert c["closed"] == c["base"], f"rank {rank}: close() left threads/communicators: {c}"
        assert c["dropped"] == c["base"], f"rank {rank}: dropped optimizers leaked: {c}"
        threads, comms = c["final"]
        assert comms == 0 and threads <= 1, f"rank {rank}: finalize() left {c['final']}"
