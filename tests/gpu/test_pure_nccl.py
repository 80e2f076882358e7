"""pure_nccl, torch's nccl backend and CUDA tensors over mpi/gloo, with codecs on the device.

Skipped without CUDA (and CuPy for pure_nccl), with the reason. A world of one on one GPU
checks the paths end to end; two ranks need two GPUs for NCCL (it refuses two ranks on one
device), so the one-GPU two-rank test uses mpi and gloo.
"""

import pytest
import torch

from tests.multirank import run_mpi, run_torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _needs_cupy():
    from commopt.comm.nccl import nccl_unavailable_reason

    reason = nccl_unavailable_reason()  # CuPy missing, or CuPy without libnccl
    if reason:
        pytest.skip(reason)


@cuda
def test_pure_nccl_one_rank_contract():
    _needs_cupy()
    out = run_mpi(
        """
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
""",
        1,
        timeout=180,
    )
    assert out[0].strip() == "ok"


@cuda
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_cuda_tensors_two_ranks(backend):
    code = f"""
import torch, commopt
torch.cuda.set_device(0)
comm = commopt.create_communicator({backend!r}{", backend='gloo'" if backend == "torch" else ""})
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
    out = run_mpi(
        """
import torch, commopt
from commopt.comm.launcher import detect_launcher
torch.cuda.set_device(detect_launcher().local_rank)
comm = commopt.create_communicator("pure_nccl")
t = torch.full((4097,), float(comm.rank + 1), device="cuda", dtype=torch.bfloat16)
comm.allreduce(t); assert torch.all(t == 3.0)
print("ok")
""",
        2,
        timeout=180,
    )
    assert [o.strip() for o in out] == ["ok", "ok"]


@cuda
@pytest.mark.parametrize("comm_name", ["pure_nccl", "torch"])
def test_codecs_reduce_cuda_tensors_in_a_world_of_one(comm_name):
    # every codec's Triton kernels inside the scatter-reduce collective, on the device
    if comm_name == "pure_nccl":
        _needs_cupy()
    runner = run_mpi if comm_name == "pure_nccl" else run_torch
    extra = ", backend='nccl'" if comm_name == "torch" else ""
    out = runner(
        f"""
import torch, commopt
from commopt import collectives
from commopt.codecs import RngKey, get_codec
torch.cuda.set_device(0)
comm = commopt.create_communicator({comm_name!r}{extra})
if {comm_name!r} == "torch":
    assert comm.backend == "nccl", comm.backend
x = torch.randn(100_003, device="cuda")
for name in ("none", "fp16", "bf16", "qsgd8", "qsgd4", "qsgd2", "qsgd4+ef"):
    codec = get_codec(name)
    t = x.clone()
    collectives.allreduce(comm, t, codec, algorithm="scatter_reduce", rng=RngKey(0, 0, 1), key="b")
    # a world of one: the result is decode(encode(x)), within the codec's error bound
    bound = {
            "none": 0, "fp16": 2**-11, "bf16": 2**-8, "qsgd8": 1 / 127, "qsgd4": 1 / 7,
             "qsgd2": 1.0, "qsgd4+ef": 1 / 7}[name] * 1.01
    assert t.is_cuda and float((t - x).abs().max()) <= bound * float(x.abs().max()), name
comm.finalize()
print("ok")
""",
        1,
        timeout=300,
    )
    assert out[0].strip() == "ok"


@cuda
def test_pure_nccl_world_of_one_work_contract_and_finalize():
    _needs_cupy()
    out = run_mpi(
        """
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
""",
        1,
        timeout=180,
    )
    assert out[0].strip().splitlines()[-1] == "ok"


@pytest.mark.skipif(
    torch.cuda.device_count() < 4,
    reason="hierarchical needs 4 CUDA devices "
    "(2 fake nodes x 2 GPUs; NCCL allows one rank per GPU)",
)
def test_pure_nccl_hierarchical_four_gpus():
    _needs_cupy()
    out = run_mpi(
        """
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
""",
        4,
        timeout=240,
    )
    assert [o.strip().splitlines()[-1] for o in out] == ["ok"] * 4
