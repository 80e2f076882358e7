"""Optimizers: the multi-node wrapper, LARS and the large-batch learning-rate schedules.

    >>> import torch, commopt
    >>> from commopt.optim import create_multi_node_optimizer
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = create_multi_node_optimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1), commopt.create_communicator("local")
    ... )
    >>> type(opt).__name__
    'MultiNodeOptimizer'

Names load on first use, so ``import commopt.optim`` stays cheap and each part works even
while another is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it
_EXPORTS = {
    "create_multi_node_optimizer": "commopt.optim.multi_node",
    "MultiNodeOptimizer": "commopt.optim.multi_node",
    "ModelMismatchError": "commopt.optim.multi_node",
    "save_checkpoint": "commopt.optim.checkpoint_files",
    "load_checkpoint": "commopt.optim.checkpoint_files",
    "drop_codec_state": "commopt.optim.checkpoint",
    "LARS": "commopt.optim.layerwise",
    "lars": "commopt.optim.layerwise",
    "LayerwiseAdaptation": "commopt.optim.layerwise",
    "exclude_bias_and_norm": "commopt.optim.layerwise",
    "trust_ratios": "commopt.optim.layerwise",
    "poly_warmup_lr": "commopt.optim.lr_schedules",
    "step_warmup_lr": "commopt.optim.lr_schedules",
    "PolyWarmup": "commopt.optim.lr_schedules",
    "StepWarmup": "commopt.optim.lr_schedules",
    "LarsDefaults": "commopt.optim.lr_schedules",
    "mlperf_lars_defaults": "commopt.optim.lr_schedules",
    "chainermn_step_lr": "commopt.optim.lr_schedules",
    "CHAINERMN_MILESTONES": "commopt.optim.lr_schedules",
    "lr_schedules": "commopt.optim.lr_schedules",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'commopt.optim' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if name == module_name.rsplit(".", 1)[1] else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
