"""Pieces every recipe shares, one helper per job: launcher-aware communicator creation, the
device and CPU threads, the commopt command-line options and optimizer factory, and atomic
checkpoint writes. What a run reports (JSON lines, a progress bar) is ``recipes.run_log``.

``--communicator auto`` picks ``mpi`` under mpirun/mpiexec/srun, ``torch`` under torchrun and
``local`` for a single process. Under srun with ``--communicator torch`` the Slurm variables
stand in for torchrun's (``MASTER_ADDR`` must still be exported).

    >>> communicator_for_launcher("torchrun"), communicator_for_launcher("openmpi")
    ('torch', 'mpi')
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch

COMMUNICATORS = ("auto", "mpi", "torch", "pure_nccl", "local")


class RecipeError(ValueError):
    """Bad command-line input: the message says what to do."""


def communicator_for_launcher(launcher: str) -> str:
    """The communicator that fits how the ranks were started."""
    if launcher == "torchrun":
        return "torch"
    if launcher in ("openmpi", "mpich", "slurm"):
        return "mpi"
    return "local"


def launch_info():
    from commopt.comm.launcher import detect_launcher

    return detect_launcher()


def add_commopt_arguments(parser: argparse.ArgumentParser) -> None:
    """The commopt options every recipe takes."""
    g = parser.add_argument_group("communication (commopt)")
    g.add_argument(
        "--communicator",
        default="auto",
        choices=COMMUNICATORS,
        help="auto: torch under torchrun, mpi under mpirun/srun, local for one process",
    )
    g.add_argument(
        "--allreduce-grad-dtype",
        default=None,
        choices=("float32", "float16", "bfloat16"),
        help="dtype gradients travel in (ChainerMN's FP16 allreduce: float16)",
    )
    g.add_argument(
        "--compression",
        default=None,
        metavar="CODEC",
        help="gradient codec: fp16, bf16, qsgd4, qsgd8, qsgd4+ef (error feedback)",
    )
    g.add_argument(
        "--double-buffering",
        nargs="?",
        const=True,
        default=False,
        type=lambda v: v if v in ("compensated", "stale") else _bad_mode(v),
        help="overlap step t's allreduce with step t+1's compute, each step applying the "
        "previous step's average at the weights its local gradient predicts (the compensated "
        "schedule, as '--double-buffering compensated'); '--double-buffering stale': ChainerMN's "
        "plain schedule (any optimizer, at an accuracy cost)",
    )
    g.add_argument(
        "--no-synchronous-embeddings",
        action="store_true",
        help="under compensated double buffering, double-buffer the embedding tables too "
        "(by default they reduce synchronously)",
    )
    g.add_argument(
        "--no-synchronous-vectors",
        action="store_true",
        help="under compensated double buffering, double-buffer the 1-D tensors (biases, "
        "norms) too (by default they reduce synchronously)",
    )
    g.add_argument(
        "--no-overlap", action="store_true", help="reduce after backward instead of during it"
    )
    g.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket size")


def _bad_mode(value: str) -> str:
    raise argparse.ArgumentTypeError(
        f"--double-buffering takes no value, 'compensated' or 'stale', got {value!r}"
    )


def check_commopt_arguments(args: argparse.Namespace) -> None:
    if args.compression is not None:
        try:
            from commopt.codecs.registry import get_codec
        except ImportError:
            return  # the codecs are not built yet: the optimizer reports it
        try:
            get_codec(args.compression)
        except (ValueError, TypeError) as exc:
            raise RecipeError(f"--compression {args.compression}: {exc}") from None
    if args.bucket_cap_mb <= 0:
        raise RecipeError(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")


def _slurm_as_torchrun() -> None:
    """torch.distributed reads torchrun's variables; derive them from Slurm's under srun."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    if "MASTER_ADDR" not in env:
        raise RecipeError(
            "--communicator torch under srun needs MASTER_ADDR: "
            "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)"
        )
    env.setdefault("MASTER_PORT", "29500")
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")


def create_communicator(requested: str = "auto"):
    """The commopt communicator for this process (``auto`` picks from the launcher)."""
    import commopt

    name = communicator_for_launcher(launch_info().name) if requested == "auto" else requested
    if name == "torch":
        _slurm_as_torchrun()
    return commopt.create_communicator(name)


def choose_device(requested: str = "auto") -> torch.device:
    """``cuda:<local rank>`` when CUDA is there (or asked for), else the CPU.

    Called before the communicator starts, so NCCL resources land on the right GPU.
    """
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RecipeError("--device cuda: no CUDA device visible to this process")
    local = launch_info().local_rank % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def set_cpu_threads(requested: int | None, ranks_per_node: int) -> int:
    """Threads per rank: the request, else $OMP_NUM_THREADS, else cores / ranks on this node."""
    if requested is None:
        env = os.environ.get("OMP_NUM_THREADS")
        requested = int(env) if env else max(1, (os.cpu_count() or 1) // max(1, ranks_per_node))
    torch.set_num_threads(requested)
    return requested


def multi_node_optimizer(
    optimizer, comm, args: argparse.Namespace, *, model=None, seed=None, **options
):
    """``commopt.create_multi_node_optimizer`` with the recipe's command-line options
    (``options``: more keyword arguments, e.g. a schedule's own)."""
    import commopt

    return commopt.create_multi_node_optimizer(
        optimizer,
        comm,
        double_buffering=args.double_buffering,
        allreduce_grad_dtype=args.allreduce_grad_dtype,
        compression=args.compression,
        overlap=not args.no_overlap,
        bucket_cap_mb=args.bucket_cap_mb,
        model=model,
        seed=seed,
        synchronous_embeddings=not getattr(args, "no_synchronous_embeddings", False),
        synchronous_vectors=not getattr(args, "no_synchronous_vectors", False),
        **options,
    )


def config_label(args: argparse.Namespace) -> str:
    """A short name of the communication configuration, e.g. ``qsgd4+db``."""
    parts = [args.compression or args.allreduce_grad_dtype or "fp32"]
    if args.double_buffering:
        # (no value: the compensated schedule, double_buffering=True)
        parts.append("stale" if args.double_buffering == "stale" else "comp")
        if getattr(args, "no_synchronous_embeddings", False):
            parts.append("stale-embeddings")
        if getattr(args, "no_synchronous_vectors", False):
            parts.append("stale-vectors")
    if args.no_overlap:
        parts.append("no-overlap")
    return "+".join(parts)


def state_digest(module: torch.nn.Module) -> str:
    """SHA-256 over parameters and buffers: equal digests mean bit-identical models."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(
            t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if t.numel()
            else b""
        )
    return h.hexdigest()[:16]


def atomic_save(obj, path: str | os.PathLike) -> None:
    """torch.save to a temporary name, fsync, then rename: a crash never leaves half a file.

    The folder is created when missing; the temporary name carries the process id, so two
    processes saving the same path never write into one temporary file. The file and the
    rename are synced to disk before this returns (a power loss keeps the old or the new).
    """
    from commopt.checkpointing.atomic import fsync_dir

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
