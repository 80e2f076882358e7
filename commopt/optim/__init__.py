"""Optimizers: the multi-node wrapper, LARS and the large-batch LR schedules.

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
    "poly_warmup_lr": "commopt.optim.schedules",
    "step_warmup_lr": "commopt.optim.schedules",
    "PolyWarmup": "commopt.optim.schedules",
    "StepWarmup": "commopt.optim.schedules",
    "LarsDefaults": "commopt.optim.schedules",
    "mlperf_lars_defaults": "commopt.optim.schedules",
    "chainermn_step_lr": "commopt.optim.schedules",
    "schedules": "commopt.optim.schedules",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'commopt.optim' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if name == module_name.rsplit(".", 1)[1] else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
