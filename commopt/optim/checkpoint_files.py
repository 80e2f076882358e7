"""Save and resume a MultiNodeOptimizer run: each rank writes only its own state.

A checkpoint is a directory of ``torch.distributed.checkpoint`` (DCP) checkpoints:
``replicated/`` (model and optimizer state, the same on every rank: written once, by
rank 0) and ``rank{r}/`` (rank r's error-feedback residuals, written by rank r). Its size
per rank does not grow with the number of ranks and no rank reads a peer's residuals.
DCP runs with ``no_dist=True``: it needs no torch process group, so this works with
every commopt communicator (``mpi`` included); the communicator only provides a barrier.

    >>> import tempfile, torch, commopt
    >>> from commopt.optim import create_multi_node_optimizer, save_checkpoint, load_checkpoint
    >>> comm = commopt.create_communicator("local")
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = create_multi_node_optimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model, compression="qsgd4+ef"
    ... )
    >>> model(torch.ones(3, 4)).sum().backward(); opt.step()
    >>> path = tempfile.mkdtemp() + "/ckpt"
    >>> save_checkpoint(path, model, opt, extra={"epoch": 3})
    >>> load_checkpoint(path, model, opt)
    {'epoch': 3}
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

from commopt.optim.checkpoint import drop_codec_state, join_rank_state, split_rank_state

__all__ = ["checkpoint_bytes", "load_checkpoint", "save_checkpoint"]

REPLICATED = "replicated"


def _rank_dir(path: Path, rank: int) -> Path:
    return path / f"rank{rank}"


def save_checkpoint(
    path: str | os.PathLike, model, optimizer, *, extra: dict | None = None
) -> None:
    """Write ``model``, ``optimizer`` (a MultiNodeOptimizer) and ``extra`` under ``path``.

    A collective call: every rank calls it; it returns once every rank's part is written.
    ``extra`` (epoch, scheduler or GradScaler state...) is saved with the replicated part.
    """
    dcp = _dcp()
    path = Path(path)
    comm = optimizer.comm
    replicated, own = split_rank_state(optimizer.state_dict())
    with warnings.catch_warnings():  # "no process group: saving in a single process" is intended
        warnings.simplefilter("ignore", UserWarning)
        if comm.rank == 0:
            # Compensated double buffering: the model is saved at its true weights (each
            # rank's predicted ones are in its own part), so the file also serves inference.
            true_weights = getattr(optimizer, "true_weights", contextlib.nullcontext)
            with true_weights():
                dcp.save(
                    {"model": model.state_dict(), "optim": replicated, "extra": extra or {}},
                    checkpoint_id=str(path / REPLICATED),
                    no_dist=True,
                )
        dcp.save({"commopt_rank": own}, checkpoint_id=str(_rank_dir(path, comm.rank)), no_dist=True)
    comm.barrier()  # the checkpoint is complete when any rank returns


def load_checkpoint(
    path: str | os.PathLike, model, optimizer, *, reset_codec_state: bool = False
) -> dict:
    """Restore what :func:`save_checkpoint` wrote into ``model`` and ``optimizer``; return ``extra``.

    Each rank reads the replicated part and its own ``rank{r}`` part. Resuming error
    feedback with another number of ranks raises a ValueError that names both counts;
    ``reset_codec_state=True`` restores everything else and restarts the residuals at zero.
    """
    path = Path(path)
    rank = optimizer.comm.rank
    if not (path / REPLICATED).is_dir():
        raise FileNotFoundError(
            f"{path} is not a commopt checkpoint (no {REPLICATED}/ inside); "
            "write one with commopt.optim.save_checkpoint"
        )
    shared = _read(path / REPLICATED)
    optim = shared["optim"]
    # DCP stores dict keys as strings; torch optimizers index their state by int.
    optim["state"] = {int(k): v for k, v in optim.get("state", {}).items()}
    mine = _rank_dir(path, rank)
    if mine.is_dir():
        state = join_rank_state(optim, _read(mine)["commopt_rank"])
    elif reset_codec_state:
        state = join_rank_state(
            optim, {"rank": rank, "world_size": optimizer.comm.size, "codec_state": {}}
        )
    else:
        saved = sorted(p.name for p in path.glob("rank*"))
        raise ValueError(
            f"rank {rank}: {path} holds no state for this rank (saved by {len(saved)} ranks: "
            f"{', '.join(saved)}); resume with that many ranks, or pass "
            "reset_codec_state=True to restart the error-feedback residuals at zero"
        )
    if reset_codec_state:
        state = drop_codec_state(state)
    model.load_state_dict(shared["model"])
    optimizer.load_state_dict(state)
    return shared.get("extra", {})


def checkpoint_bytes(path: str | os.PathLike) -> dict[str, int]:
    """Bytes on disk per part (``replicated``, ``rank0``, ...) of a checkpoint directory."""
    path = Path(path)
    return {
        d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        for d in sorted(path.iterdir())
        if d.is_dir()
    }


def _read(directory: Path) -> dict[str, Any]:
    dcp = _dcp()
    # Reads every key without a template (a fresh optimizer has no state to load into yet),
    # as torch's own dcp_to_torch_save does; no_dist: each rank reads its own parts, with
    # or without a torch process group.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    with warnings.catch_warnings():  # "no process group: loading in a single process" is intended
        warnings.simplefilter("ignore", UserWarning)
        _load_state_dict(
            state,
            storage_reader=dcp.FileSystemReader(str(directory)),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    return state


def _dcp():
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as exc:  # torch built without distributed support
        raise ImportError(
            "commopt checkpoints need torch.distributed.checkpoint: install a "
            "torch build with distributed support (pip install torch)"
        ) from exc
    return dcp
