"""Checkpoints that survive the job: atomic, checksummed, numbered, resumable after a restart.

:class:`CheckpointManager` keeps numbered checkpoints of a MultiNodeOptimizer run under one
folder, with a ``latest`` pointer and the last ``keep`` of them; a restarted job (torchrun
``--max-restarts``, a scheduler's requeue) calls :meth:`CheckpointManager.load_latest` and
continues where the last complete checkpoint left it. :mod:`commopt.checkpointing.atomic` is
the directory layer (staging, fsync, manifest, rename), below the optimizer, which writes
through it; the manager lives with the optimizer (:mod:`commopt.optim.checkpoint_manager`).

Names load on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CheckpointManager": "commopt.optim.checkpoint_manager",
    "Restored": "commopt.optim.checkpoint_manager",
    "CheckpointError": "commopt.checkpointing.atomic",
    "verify_checkpoint": "commopt.optim.checkpoint_manager",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'commopt.checkpointing' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
