"""Stream ordering of the CUDA transports on a real GPU (skipped without CUDA, with the reason).

The data is produced on a side stream behind a long sleep kernel: a transport that ordered
the collective after any other stream (or after a host thread's) would read the buffer
before the fill and these tests would see the old values.
"""

import pytest
import torch

from tests.multirank import run_mpi, run_torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SIDE_STREAM = """
import torch, commopt
from commopt import collectives
torch.cuda.set_device(0)
comm = commopt.create_communicator({backend!r}{options})
side = torch.cuda.Stream()
n = 1 << 20
for trial in range(3):
    send = torch.zeros(n, device="cuda")
    recv = torch.full((n * comm.size,), -1.0, device="cuda")
    flat = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)           # ~0.1 s: the fill comes late
        send.fill_(comm.rank + 1.0)
        flat.fill_(2.0)
        w = comm.allgather(send, recv, async_op=True)
        r = collectives.allreduce(comm, flat, None, average=False, async_op=True)
        w.wait(); r.wait()
        seen = recv.clone()                      # on the side stream, after wait()
        total = flat.clone()
    r.synchronize()
    torch.cuda.synchronize()
    want = torch.arange(1, comm.size + 1, device="cuda").repeat_interleave(n).float()
    assert torch.equal(seen, want), (trial, seen[::n].tolist())
    assert torch.all(total == 2.0 * comm.size), (trial, total[:4].tolist())
comm.finalize()
print("ok")
"""


def _needs_cupy():
    from commopt.comm.nccl import nccl_unavailable_reason

    reason = nccl_unavailable_reason()  # CuPy missing, or CuPy without libnccl
    if reason:
        pytest.skip(reason)


@cuda
def test_pure_nccl_orders_after_the_callers_side_stream():
    _needs_cupy()
    out = run_mpi(SIDE_STREAM.format(backend="pure_nccl", options=""), 1, timeout=240)
    assert out[0].strip().splitlines()[-1] == "ok"


@cuda
def test_torch_nccl_orders_after_the_callers_side_stream():
    out = run_torch(SIDE_STREAM.format(backend="torch", options=", backend='nccl'"), 1, timeout=240)
    assert out[0].strip().splitlines()[-1] == "ok"


@cuda
def test_optimizer_on_pure_nccl_uses_the_users_communicator_and_no_thread():
    _needs_cupy()
    out = run_mpi(
        """
import threading, torch, commopt
torch.cuda.set_device(0)
comm = commopt.create_communicator("pure_nccl")
model = torch.nn.Linear(64, 8).cuda()
before = threading.active_count()
for db in (False, True):
    opt = commopt.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                              model=model, double_buffering=db)
    assert opt._data_comm is comm
    side = torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(side):
            model(torch.ones(4, 64, device="cuda")).sum().backward()
            opt.step()
    opt.flush(); opt.wait()
    assert all(torch.isfinite(p).all() for p in model.parameters())
assert threading.active_count() <= before + 1, threading.enumerate()  # no collectives worker
comm.finalize()
print("ok")
""",
        1,
        timeout=240,
    )
    assert out[0].strip().splitlines()[-1] == "ok"
