"""Numbered checkpoints under one folder, a ``latest`` pointer, and resuming after a restart.

``CheckpointManager(root, keep=K)`` saves ``root/step-00000120`` (through
:func:`commopt.optim.save_checkpoint`: staged, checksummed, renamed into place), then
points ``root/latest`` at it (written to a temporary name, fsynced, renamed over the old
pointer) and removes all but the last ``keep`` checkpoints. The pointer only ever names a
complete checkpoint, so a job killed at any moment resumes from the last one that was.

    >>> import tempfile, torch, commopt
    >>> from commopt.optim import create_multi_node_optimizer
    >>> comm = commopt.create_communicator("local")
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    >>> ckpts = CheckpointManager(tempfile.mkdtemp(), keep=2)
    >>> ckpts.load_latest(model, opt) is None  # a fresh start
    True
    >>> for step in (10, 20, 30):
    ...     path = ckpts.save(step, model, opt, extra={"epoch": step // 10})
    >>> ckpts.steps()
    [20, 30]
    >>> restored = ckpts.load_latest(model, opt)
    >>> restored.step, restored.extra
    (30, {'epoch': 3})
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commopt.checkpointing.atomic import (
    CheckpointError,
    read_manifest,
    resolve,
    staging_path,
    verify_part,
    write_text_atomic,
)
from commopt.optim.checkpoint_files import load_checkpoint, save_checkpoint

__all__ = ["CheckpointManager", "Restored", "verify_checkpoint"]

LATEST = "latest"
_NAME = re.compile(r"step-(\d{8,})")


@dataclass(frozen=True)
class Restored:
    """What :meth:`CheckpointManager.load_latest` resumed from."""

    step: int
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)


class CheckpointManager:
    """Save numbered checkpoints of a MultiNodeOptimizer run and resume from the latest.

    ``root`` must be on a file system every rank shares. ``save`` and ``load_latest`` are
    collective calls (every rank calls them with the same arguments).
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 2):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (checkpoints kept), got {keep!r}")
        self.root = Path(root)
        self.keep = keep

    def path(self, step: int) -> Path:
        """Where checkpoint ``step`` lives."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        return self.root / f"step-{step:08d}"

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints under ``root``, oldest first."""
        if not self.root.is_dir():
            return []
        found = {_step_of(p.name) for p in self.root.iterdir()} - {None}
        return sorted(s for s in found if s is not None and resolve(self.path(s)) is not None)

    def latest_step(self) -> int | None:
        """The step ``latest`` points at, or None when no checkpoint was completed yet."""
        pointer = self.root / LATEST
        try:
            text = pointer.read_text()
        except FileNotFoundError:
            return None
        except UnicodeDecodeError:
            text = "<not text>"
        m = _NAME.fullmatch(text.strip())
        if m is None:
            raise CheckpointError(
                f"{pointer} is damaged: it holds {text.strip()[:60]!r}, not a checkpoint name "
                f"like step-00000100; complete checkpoints here: {self.steps() or 'none'} "
                "(write the name of one into it to resume from that one)"
            )
        return int(m[1])

    def save(
        self, step: int, model: Any, optimizer: Any, *, extra: dict[str, Any] | None = None
    ) -> Path:
        """Save checkpoint ``step``, point ``latest`` at it, keep the last ``keep``.

        Returns once the checkpoint is complete on disk and ``latest`` names it.
        """
        path = self.path(step)
        comm = optimizer.comm
        save_checkpoint(path, model, optimizer, extra=extra)
        error = None
        if comm.rank == 0:
            try:
                write_text_atomic(self.root / LATEST, path.name + "\n")
                self._prune(step)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = comm.bcast_obj(error, root=0)
        if error is not None:
            raise CheckpointError(
                f"rank 0 could not point {self.root / LATEST} at {path.name}: {error}"
            )
        return path

    def load_latest(self, model: Any, optimizer: Any, **kwargs: Any) -> Restored | None:
        """Restore the checkpoint ``latest`` names; None (nothing restored) when there is none.

        ``kwargs`` go to :func:`commopt.optim.load_checkpoint` (``residuals=...`` to resume
        with another number of ranks). A damaged checkpoint raises :class:`CheckpointError`
        naming the file: nothing is restored from it.
        """
        step = self.latest_step()
        if step is None:
            return None
        return self.load(step, model, optimizer, **kwargs)

    def load(self, step: int, model: Any, optimizer: Any, **kwargs: Any) -> Restored:
        """Restore checkpoint ``step``."""
        path = self.path(step)
        if resolve(path) is None:
            raise CheckpointError(
                f"checkpoint {path} is missing (complete checkpoints here: "
                f"{self.steps() or 'none'})"
            )
        extra = load_checkpoint(path, model, optimizer, **kwargs)
        return Restored(step=step, path=path, extra=extra)

    def _prune(self, latest: int) -> None:
        """Keep ``latest`` and the ``keep - 1`` newest before it; remove the rest (newer
        ones too: a killed run's checkpoints after the one it resumed from) and leftovers."""
        older = [s for s in self.steps() if s < latest]
        kept = {latest, *older[len(older) - (self.keep - 1) :]} if self.keep > 1 else {latest}
        for p in self.root.iterdir():
            step = _step_of(p.name)
            if step is None or (step in kept and p != staging_path(self.path(step))):
                continue
            shutil.rmtree(p, ignore_errors=True)


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every part of the checkpoint at ``path`` against its manifest; return the manifest.

    Raises :class:`CheckpointError` naming the first missing, truncated or altered file.
    """
    where = resolve(Path(path))
    if where is None:
        raise CheckpointError(f"{path} holds no complete commopt checkpoint")
    manifest = read_manifest(where)
    for part in sorted(manifest["parts"]):
        verify_part(where, manifest, part)
    return manifest


def _step_of(name: str) -> int | None:
    """The step of a checkpoint folder's name, its staging name or its aside name."""
    if name.startswith(".") and name.endswith((".partial", ".old")):
        name = name[1 : name.rindex(".")]
    m = _NAME.fullmatch(name)
    return int(m[1]) if m else None
