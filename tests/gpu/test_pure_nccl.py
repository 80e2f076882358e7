"""pure_nccl and CUDA tensors over mpi/gloo. Skipped without CUDA (and CuPy), with the reason."""
import pytest
import torch

from tests.multirank import run_mpi, run_torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _needs_cupy():
    pytest.importorskip("cupy", reason="pure_nccl needs CuPy: pip install cupy-cuda12x")


@cuda
def test_pure_nccl_one_rank_contract():
    _needs_cupy()
    out = run_mpi("""
import torch, commopt
torch.cuda.set_device(0)
comm = commopt.create_communicator("pure_nccl")
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    t = torch.arange(1031, device="cuda").to(dtype)
    comm.allreduce(t)
    assert torch.equal(t, torch.arange(1031, device="cuda").to(dtype)), dtype
    w = comm.allreduce(t, async_op=True); w.wait()
s = torch.arange(8, device="cuda", dtype=torch.uint8); r = torch.empty_like(s)
comm.alltoall(s, r); assert torch.equal(r, s)
comm.allgather(s, r); assert torch.equal(r, s)
comm.broadcast(s); comm.barrier()
print("ok")
""", 1, timeout=180)
    assert out[0].strip() == "ok"


@cuda
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_cuda_tensors_two_ranks(backend):
    code = f"""
import torch, commopt
torch.cuda.set_device(0)
comm = commopt.create_communicator({backend!r})
t = torch.full((1000,), float(comm.rank + 1), device="cuda")
comm.allreduce(t)
assert torch.all(t == 3.0), t[:4]
print("ok")
"""
    runner = run_mpi if backend == "mpi" else run_torch
    out = runner(code, 2, timeout=180)
    assert [o.strip() for o in out] == ["ok", "ok"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_pure_nccl_two_gpus():
    _needs_cupy()
    out = run_mpi("""
import torch, commopt
from commopt.comm.launcher import detect_launcher
torch.cuda.set_device(detect_launcher().local_rank)
comm = commopt.create_communicator("pure_nccl")
t = torch.full((4097,), float(comm.rank + 1), device="cuda", dtype=torch.bfloat16)
comm.allreduce(t); assert torch.all(t == 3.0)
print("ok")
""", 2, timeout=180)
    assert [o.strip() for o in out] == ["ok", "ok"]


@cuda
def test_pure_nccl_world_of_one_work_contract_and_finalize():
    _needs_cupy()
    out = run_mpi("""
import torch, commopt
torch.cuda.set_device(0)
comm = commopt.create_communicator("pure_nccl")
assert comm.stream_ordered and comm.node_names == [comm.node_name]
t = torch.ones(1 << 20, device="cuda")
w = comm.allreduce(t, async_op=True)
w.synchronize()                       # host blocks until the result is in memory
assert w.is_completed() and torch.all(t == 1.0)
comm.finalize(); comm.finalize()      # twice is fine
try:
    comm.allreduce(t)
except RuntimeError as exc:
    assert "finalized" in str(exc)
else:
    raise AssertionError("a finalized communicator still ran a collective")
print("ok")
""", 1, timeout=180)
    assert out[0].strip().splitlines()[-1] == "ok"


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="hierarchical needs 4 CUDA devices "
                    "(2 fake nodes x 2 GPUs; NCCL allows one rank per GPU)")
def test_pure_nccl_hierarchical_four_gpus():
    _needs_cupy()
    out = run_mpi("""
import os, torch, commopt
from commopt import collectives
from commopt.collectives.choice import choose_algorithm
from commopt.comm.launcher import detect_launcher
rank = detect_launcher().rank
os.environ["COMMOPT_NODE_NAME"] = f"n{rank // 2}"
torch.cuda.set_device(detect_launcher().local_rank)
comm = commopt.create_communicator("pure_nccl")
assert choose_algorithm(comm, None) == "hierarchical", comm.node_names
flat = torch.full((100_003,), float(rank + 1), device="cuda")
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    torch.cuda._sleep(100_000_000)
    flat.mul_(2.0)
    collectives.allreduce(comm, flat, None, average=False).synchronize()
assert torch.all(flat == 2.0 * (1 + 2 + 3 + 4)), flat[:4]
comm.finalize()
print("ok")
""", 4, timeout=240)
    assert [o.strip().splitlines()[-1] for o in out] == ["ok"] * 4
