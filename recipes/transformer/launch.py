"""Which communicator and device a rank uses, from how it was started.

``--communicator auto`` picks ``mpi`` under mpirun/mpiexec/srun, ``torch`` under torchrun
and ``local`` for a single process. Under srun with ``--communicator torch`` the Slurm
variables stand in for torchrun's (``MASTER_ADDR`` must still be exported).

    >>> communicator_name("auto", launcher="torchrun"), communicator_name("auto", launcher="none")
    ('torch', 'local')
"""
from __future__ import annotations

import os

import torch


def launcher():
    from commopt.comm.launcher import detect_launcher

    return detect_launcher()


def communicator_name(requested: str, *, launcher: str) -> str:
    if requested != "auto":
        return requested
    if launcher == "torchrun":
        return "torch"
    if launcher in ("openmpi", "mpich", "slurm"):
        return "mpi"
    return "local"


def _slurm_as_torchrun() -> None:
    """torch.distributed reads torchrun's variables; derive them from Slurm's under srun."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    if "MASTER_ADDR" not in env:
        raise RuntimeError(
            "--communicator torch under srun needs MASTER_ADDR: "
            "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)"
        )
    env.setdefault("MASTER_PORT", "29500")
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")


def create_communicator(requested: str):
    """The commopt communicator for this process (see the module docstring)."""
    import commopt

    info = launcher()
    name = communicator_name(requested, launcher=info.name)
    if name == "torch":
        _slurm_as_torchrun()
    return commopt.create_communicator(name)


def choose_device(requested: str) -> torch.device:
    """``cuda:<local rank>`` when CUDA is there (or asked for), else the CPU.

    Called before the communicator starts, so NCCL resources land on the right GPU.
    """
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was given but torch sees no CUDA device")
    index = launcher().local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def set_cpu_threads(requested: int | None, ranks_per_node: int) -> int:
    """Threads per rank: the request, else $OMP_NUM_THREADS, else cores / ranks on this node."""
    if requested is None:
        env = os.environ.get("OMP_NUM_THREADS")
        requested = int(env) if env else max(1, (os.cpu_count() or 1) // max(1, ranks_per_node))
    torch.set_num_threads(requested)
    return requested
