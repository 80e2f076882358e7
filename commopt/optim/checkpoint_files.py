"""Save and resume a MultiNodeOptimizer run: each rank writes only its own state.

A checkpoint is a directory of ``torch.distributed.checkpoint`` (DCP) checkpoints:
``replicated/`` (model and optimizer state, the same on every rank: written once, by
rank 0) and ``rank{r}/`` (rank r's error-feedback residuals, written by rank r). Its size
per rank does not grow with the number of ranks and no rank reads a peer's residuals.
DCP runs with ``no_dist=True``: it needs no torch process group, so this works with
every commopt communicator (``mpi`` included).

The directory is written under a staging name and renamed into place once every rank's
part is on disk, with ``MANIFEST.json`` listing each file's size and SHA-256
(:mod:`commopt.checkpointing.atomic`): a job killed while saving leaves the previous
checkpoint loadable, and loading checks each file it reads first. For numbered
checkpoints with a ``latest`` pointer, see :class:`commopt.checkpointing.CheckpointManager`.

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

from commopt.checkpointing.atomic import (
    MANIFEST,
    CheckpointError,
    read_manifest,
    resolve,
    save_parts,
    verify_part,
)
from commopt.collectives.residuals import SAVED_BY_RANKS
from commopt.optim.checkpoint import (
    drop_codec_state,
    has_codec_state,
    join_rank_state,
    split_rank_state,
)

__all__ = ["RESIDUAL_MODES", "checkpoint_bytes", "load_checkpoint", "save_checkpoint"]

REPLICATED = "replicated"

#: What :func:`load_checkpoint` does with error-feedback residuals saved by another number of
#: ranks: ``reshard`` (the default: each bucket's residuals summed over the saved ranks, element
#: by element, and handed to this job's ranks, see :mod:`commopt.collectives.residuals`; those
#: whose place cannot be known are dropped, and rank 0 logs which), ``refuse`` (raise) or
#: ``drop`` (restart them all at zero).
RESIDUAL_MODES = ("reshard", "refuse", "drop")


def _part_name(rank: int) -> str:
    return f"rank{rank}"


def save_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any,
    *,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``model``, ``optimizer`` (a MultiNodeOptimizer) and ``extra`` under ``path``.

    A collective call: every rank calls it; it returns once every rank's part is on disk
    and the checkpoint is renamed into place (a checkpoint already at ``path`` is replaced
    only then). ``extra`` (epoch, sampler, scheduler or GradScaler state...) is saved with
    the replicated part, from rank 0. ``path`` must be on a file system every rank shares.
    """
    dcp = _dcp()
    comm = optimizer.comm
    replicated, own = split_rank_state(optimizer.state_dict())

    def write(staging: Path) -> list[str]:
        parts = []
        with warnings.catch_warnings():  # "no process group: saving in a single process"
            warnings.simplefilter("ignore", UserWarning)
            if comm.rank == 0:
                # Compensated double buffering: the model is saved at its true weights (each
                # rank's predicted ones are in its own part), so the file also serves inference.
                true_weights = getattr(optimizer, "true_weights", contextlib.nullcontext)
                with true_weights():
                    dcp.save(
                        {"model": model.state_dict(), "optim": replicated, "extra": extra or {}},
                        checkpoint_id=str(staging / REPLICATED),
                        no_dist=True,
                    )
                parts.append(REPLICATED)
            mine = _part_name(comm.rank)
            dcp.save({"commopt_rank": own}, checkpoint_id=str(staging / mine), no_dist=True)
            parts.append(mine)
        return parts

    save_parts(path, comm, write)


def load_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any,
    *,
    reset_codec_state: bool = False,
    residuals: str = "reshard",
) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote into ``model`` and ``optimizer``; return ``extra``.

    Each rank checks the replicated part and its own ``rank{r}`` part against the manifest
    (a missing, truncated or altered file raises :class:`CheckpointError` naming it), then
    restores them. Resuming with another number of ranks restores the replicated part;
    error-feedback residuals, which each rank holds for itself per chunk of the
    reduce-scatter (chunks that another number of ranks cuts differently), follow
    ``residuals``: ``"reshard"`` sums them over the saved ranks and gives each rank of this
    job its share (the sum is what the mean carries; residuals of the hierarchical plan, whose
    chunks depend on the node layout, and a low-rank codec's state are dropped, logged on rank
    0), ``"refuse"`` raises a ValueError naming both counts, ``"drop"`` restarts them all at
    zero (the error they carried, one step's quantisation error, is lost). State
    saved between steps of compensated double buffering (each rank's predicted weights)
    only resumes with the same number of ranks. ``reset_codec_state=True`` is
    ``residuals="drop"``, at any count.
    """
    if residuals not in RESIDUAL_MODES:
        raise ValueError(f"residuals={residuals!r}: choose one of {', '.join(RESIDUAL_MODES)}")
    if reset_codec_state:
        residuals = "drop"
    path = Path(path)
    comm = optimizer.comm
    rank, size = comm.rank, comm.size
    where = resolve(path)
    if where is None:
        raise FileNotFoundError(
            f"{path} is not a commopt checkpoint (no {MANIFEST} inside); "
            "write one with commopt.optim.save_checkpoint"
        )
    ckpt = _Checkpoint(where)
    shared = ckpt.read(REPLICATED)
    optim = shared["optim"]
    # DCP stores dict keys as strings; torch optimizers index their state by int.
    optim["state"] = {int(k): v for k, v in optim.get("state", {}).items()}
    if ckpt.world_size == size or (ckpt.manifest is None and ckpt.has(_part_name(rank))):
        own = ckpt.read(_part_name(rank))["commopt_rank"]
    else:
        own = _reshard(ckpt, rank, size, residuals, plans="plans" in optim.get("commopt", {}))
    state = join_rank_state(optim, own)
    if residuals == "drop":
        state = drop_codec_state(state)
    model.load_state_dict(shared["model"])
    optimizer.load_state_dict(state)
    extra: dict[str, Any] = shared.get("extra", {})
    return extra


class _Checkpoint:
    """A committed checkpoint directory: its manifest (None: written before manifests) and
    its parts, each checked against the manifest as it is read."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.manifest = read_manifest(directory) if (directory / MANIFEST).is_file() else None
        if self.manifest is not None:
            self.world_size = self.manifest["world_size"]
        else:
            self.world_size = len(list(directory.glob("rank*")))

    def has(self, part: str) -> bool:
        return (self.directory / part).is_dir()

    def read(self, part: str) -> dict[str, Any]:
        if self.manifest is not None:
            return _read(verify_part(self.directory, self.manifest, part))
        if not self.has(part):
            raise CheckpointError(f"{self.directory / part} is missing")
        return _read(self.directory / part)


def _reshard(
    ckpt: _Checkpoint, rank: int, size: int, residuals: str, *, plans: bool
) -> dict[str, Any]:
    """This rank's own state from a checkpoint saved by ``ckpt.world_size`` other ranks.

    ``reshard``: each codec's state holds every saved rank's (``SAVED_BY_RANKS``), which the
    optimizer's reducer turns into this rank's share as it loads it; ``plans``: the codec
    states are keyed by plan first."""
    saved = [ckpt.read(_part_name(r))["commopt_rank"] for r in range(ckpt.world_size)]
    if any(s.get("predicted") is not None for s in saved):
        raise ValueError(
            f"rank {rank}: the checkpoint was saved by {ckpt.world_size} ranks between steps "
            f"of compensated double buffering, but this job has {size}: each rank's predicted "
            f"weights are its own. Resume with {ckpt.world_size} ranks, or call "
            "optimizer.flush() before saving"
        )
    states = [s.get("codec_state", {}) for s in saved]
    own: dict[str, Any] = {"rank": rank, "world_size": size, "codec_state": {}}
    if not any(has_codec_state(s) for s in states) or residuals == "drop":
        return own
    if residuals == "reshard":
        own["codec_state"] = _saved_by_ranks(states, plans)
        return own
    raise ValueError(
        f"rank {rank}: the checkpoint holds codec state (error feedback) of "
        f"{ckpt.world_size} ranks but this job has {size}: each rank's residuals belong to "
        f"the chunks {ckpt.world_size} ranks cut the buckets into. Resume with "
        f"{ckpt.world_size} ranks, or pass residuals='reshard' (summed over the saved ranks "
        "and shared out again) or residuals='drop' (they restart at zero: one step's "
        "quantisation error per rank is lost)"
    )


def _saved_by_ranks(states: list[dict[str, Any]], plans: bool) -> dict[str, Any]:
    """Per codec (per plan first with ``plans``): every saved rank's state, in rank order."""
    if plans:
        keys = sorted({k for s in states for k in s})
        return {k: _saved_by_ranks([s.get(k, {}) for s in states], False) for k in keys}
    names = sorted({n for s in states for n in s})
    return {n: {SAVED_BY_RANKS: [s.get(n, {}) for s in states]} for n in names}


def checkpoint_bytes(path: str | os.PathLike[str]) -> dict[str, int]:
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
            planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    return state


def _dcp() -> Any:
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as exc:  # torch built without distributed support
        raise ImportError(
            "commopt checkpoints need torch.distributed.checkpoint: install a "
            "torch build with distributed support (pip install torch)"
        ) from exc
    return dcp
