"""The wrapper's options: checked with errors that say what to pass, and the codecs they name.

>>> import commopt
>>> from commopt.optim.options import resolve_codecs
>>> codec, plain, policy = resolve_codecs(commopt.create_communicator("local"), None, "qsgd4", None)
>>> codec.name, plain.name, policy.uncompressed
('qsgd4', 'none', 'none')
"""

from __future__ import annotations

from typing import Any

import torch

from commopt import collectives
from commopt.codecs.base import Codec
from commopt.comm.base import Communicator

__all__ = ["check_arguments", "refuse_ddp", "resolve_codecs"]

_CAST_NAMES = {None: "none", torch.float32: "none", torch.float16: "fp16", torch.bfloat16: "bf16"}


def check_arguments(
    optimizer: Any, comm: Any, model: Any, algorithm: str, bucket_cap_mb: Any
) -> None:
    """Raise a TypeError/ValueError naming the fix for a wrong argument of the wrapper."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"create_multi_node_optimizer needs a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
        )
    if not isinstance(comm, Communicator):
        raise TypeError(
            f"comm must be a commopt Communicator (commopt.create_communicator(...)), got "
            f"{type(comm).__name__}"
        )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if algorithm not in collectives.ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; one of {collectives.ALGORITHMS}")
    if not 0 < float(bucket_cap_mb) <= 2**30:  # NaN fails too; 2**30 MiB keeps int() finite
        raise ValueError(
            f"bucket_cap_mb must be a number of MiB in (0, 2**30], got {bucket_cap_mb}"
        )


def resolve_codecs(
    comm: Any, allreduce_grad_dtype: Any, compression: Any, policy: Any
) -> tuple[Codec | None, Codec, Any]:
    """(compressing codec or None, uncompressed codec, policy)."""
    from commopt.codecs import CompressionPolicy, get_codec
    from commopt.comm import parse_dtype

    dtype = (
        parse_dtype(allreduce_grad_dtype)
        if allreduce_grad_dtype is not None
        else getattr(comm, "allreduce_grad_dtype", None)
    )
    cast_name = _CAST_NAMES[dtype]
    if compression is None:
        return None, get_codec(cast_name), None
    if not isinstance(compression, (str, Codec)):
        raise TypeError(
            f"compression must be a commopt Codec or a codec name such as 'qsgd4', got "
            f"{type(compression).__name__}"
        )
    codec = get_codec(compression)
    if policy is None:
        policy = CompressionPolicy(uncompressed=cast_name)
    return codec, get_codec(policy.uncompressed), policy


def refuse_ddp(params: Any, model: Any = None) -> None:
    """Raise a ValueError when ``model`` is, or contains, a DistributedDataParallel.

    DDP averages every gradient during backward and commopt averages them again: twice the
    traffic, and the compression applied to gradients that are already averaged. The check
    looks at the ``model`` argument only (the DDP wrapper itself, or a module holding one).
    Its limit: DDP leaves no mark on the module it wraps nor on its parameters, and
    torch keeps no registry of DDP instances, so a DDP wrapper that commopt is not shown
    (``model=`` the inner module, or no ``model=``) cannot be found without walking every
    object of the process, which this check does not do. ``params`` is accepted for the
    wrapper's call and not inspected.

        >>> import torch
        >>> refuse_ddp(list(torch.nn.Linear(2, 1).parameters()), torch.nn.Linear(2, 1))
    """
    del params  # DDP's parameters carry no mark to look for (see above)
    from torch.nn.parallel import DistributedDataParallel as DDP

    if model is None or not any(isinstance(m, DDP) for m in model.modules()):
        return
    raise ValueError(
        "model is wrapped in torch.nn.parallel.DistributedDataParallel, which averages the "
        "gradients already, and commopt would average them a second time. commopt's "
        "optimizer replaces DDP: pass the plain module (ddp_model.module) and its parameters, "
        "without DistributedDataParallel; or keep DDP and use commopt's DDP communication "
        "hook instead (from commopt.integrations.ddp import CommoptHookState, commopt_hook; "
        "ddp_model.register_comm_hook(CommoptHookState(...), commopt_hook)); see "
        "docs/porting.md"
    )
