"""One-process checks of the communicator layer: names, dtypes, launchers, 16-bit sums."""

import numpy as np
import pytest
import torch

import commopt
from commopt.comm import parse_dtype
from commopt.comm.base import node_name
from commopt.comm.launcher import detect_launcher


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: horovod, local, mpi, pure_nccl, torch"):
        commopt.create_communicator("infiniband")


def test_local_world_of_one():
    comm = commopt.create_communicator("local", allreduce_grad_dtype="bf16")
    assert (comm.rank, comm.size, comm.intra_size, comm.inter_size) == (0, 1, 1, 1)
    assert comm.allreduce_grad_dtype is torch.bfloat16
    buf = torch.arange(5.0)
    comm.allreduce(buf)
    assert buf.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    recv = torch.empty(5)
    comm.alltoall(buf, recv, async_op=True).wait()
    assert torch.equal(recv, buf)


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, None),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("bfloat16", torch.bfloat16),
        (torch.float32, torch.float32),
        (np.dtype("float16"), torch.float16),
    ],
)
def test_parse_dtype(value, expected):
    assert parse_dtype(value) is expected


def test_parse_dtype_rejects_unknown():
    with pytest.raises(ValueError, match="float32, float16, bfloat16"):
        parse_dtype("int8")


def test_pure_nccl_without_cuda_says_what_is_missing():
    # Either CuPy is missing (ImportError naming it) or CUDA is (RuntimeError naming it).
    with pytest.raises((ImportError, RuntimeError), match=r"cupy|CUDA"):
        commopt.create_communicator("pure_nccl")


def test_unsupported_allreduce_dtype():
    comm = commopt.create_communicator("local")
    with pytest.raises(TypeError, match="allreduce supports"):
        comm.allreduce(torch.ones(3, dtype=torch.uint8))


@pytest.mark.parametrize(
    "env,expected",
    [
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            ("openmpi", 3, 4, 1, 2),
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            ("mpich", 1, 2, 1, 2),
        ),
        (
            {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
            ("torchrun", 5, 8, 1, 4),
        ),
        (
            {
                "SLURM_PROCID": "6",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "2",
                "SLURM_NTASKS_PER_NODE": "4(x2)",
            },
            ("slurm", 6, 8, 2, 4),
        ),
        (
            {
                "HOROVOD_RANK": "1",
                "HOROVOD_SIZE": "2",
                "HOROVOD_LOCAL_RANK": "1",
                "HOROVOD_LOCAL_SIZE": "2",
            },
            ("horovodrun", 1, 2, 1, 2),
        ),
        ({}, ("none", 0, 1, 0, 1)),
    ],
)
def test_detect_launcher(env, expected):
    info = detect_launcher(env)
    assert (info.name, info.rank, info.size, info.local_rank, info.local_size) == expected


def test_node_name_override(monkeypatch):
    monkeypatch.setenv("COMMOPT_NODE_NAME", "fake-node-7")
    assert node_name() == "fake-node-7"


def test_mpi_bf16_reduction_matches_torch():
    """The user-defined bf16 sum rounds like torch (nearest even), including NaN and Inf."""
    pytest.importorskip("mpi4py")
    from commopt.comm.mpi.user_ops import bf16_to_f32 as _bf16_to_f32
    from commopt.comm.mpi.user_ops import f32_to_bf16 as _f32_to_bf16

    g = torch.Generator().manual_seed(0)
    a = (torch.randn(10000, generator=g) * 100).bfloat16()
    b = (torch.randn(10000, generator=g) * 100).bfloat16()
    a[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")]).bfloat16()
    expected = (a.float() + b.float()).bfloat16()
    got = _f32_to_bf16(
        _bf16_to_f32(a.view(torch.int16).numpy().view(np.uint16))
        + _bf16_to_f32(b.view(torch.int16).numpy().view(np.uint16))
    )
    got_t = torch.from_numpy(got.view(np.int16)).view(torch.bfloat16)
    assert torch.isnan(got_t[0]) and got_t[1] == float("inf") and got_t[2] == -float("inf")
    assert torch.equal(got_t[3:], expected[3:])
