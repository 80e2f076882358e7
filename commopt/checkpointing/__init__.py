"""Checkpoints that survive the job: atomic, checksummed, numbered, resumable after a restart.

:class:`CheckpointManager` keeps numbered checkpoints of a MultiNodeOptimizer run under one
folder, with a ``latest`` pointer and the last ``keep`` of them; a restarted job (torchrun
``--max-restarts``, a scheduler's requeue) calls :meth:`CheckpointManager.load_latest` and
continues where the last complete checkpoint left it. :mod:`commopt.checkpointing.atomic` is
the directory layer: staging, fsync, manifest, rename.

Names load on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CheckpointManager": "commopt.checkpointing.manager",
    "Restored": "commopt.checkpointing.manager",
    "CheckpointError": "commopt.checkpointing.atomic",
    "verify_checkpoint": "commopt.checkpointing.manager",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'commopt.checkpointing' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
