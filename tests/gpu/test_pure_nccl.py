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
