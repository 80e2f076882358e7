"""What ``step()``, ``synchronize()`` and ``flush()`` do with ``double_buffering=True``.

Each step sends its own gradients and applies the previous step's averages (one step
stale): :func:`exchange` hands the buffers over (:class:`~commopt.optim.double_buffering.DoubleBuffer`
holds the reduction in flight), :func:`step` applies what the exchange handed back, and
:func:`flush` applies the last pending reduction. With ``"compensated"`` the model moves
to the predicted weights after each step and back to the true ones before an average is
applied (:mod:`~commopt.optim.compensation`). GradScaler drives these steps through
``opt.grad_scale`` (each rank unscales its own gradients before sending them).

    >>> import torch, commopt
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = commopt.create_multi_node_optimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1),
    ...     commopt.create_communicator("local"),
    ...     model=model,
    ...     double_buffering=True,
    ... )
    >>> model(torch.ones(1, 2)).sum().backward(); step(opt); opt.zero_grad()
    >>> opt.applied_steps  # sent, not applied yet
    0
    >>> flush(opt); opt.applied_steps
    1
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from commopt.optim.apply_step import apply_result
from commopt.optim.compensation import LocalGradients, unpack_replaces_grad

if TYPE_CHECKING:
    from commopt.optim.multi_node import MultiNodeOptimizer

__all__ = ["exchange", "flush", "inverse_grad_scale", "step", "synchronize"]


def inverse_grad_scale(opt: MultiNodeOptimizer) -> float:
    """1 / GradScaler's scale when GradScaler drives this step (else 1)."""
    scale = getattr(opt, "grad_scale", None)
    if scale is None:
        return 1.0
    value = float(scale) if not isinstance(scale, torch.Tensor) else float(scale.item())
    return 1.0 / value


def exchange(opt: MultiNodeOptimizer, scale: float) -> None:
    """Send this step's gradients; put the previous step's averages into ``param.grad``."""
    reducer = opt._layout
    if opt._comp is not None:
        opt._comp.local = LocalGradients.take(
            opt._all_params(), reducer.params, scale, unpack_replaces_grad(reducer)
        )
    opt._db.exchange(
        lambda buffer: opt._start(scale=scale, buffer=buffer), opt._layout, opt.zero_fill
    )


def synchronize(opt: MultiNodeOptimizer) -> None:
    """Send this step's gradients now (once a step): the previous step's averages land in
    ``param.grad``, where ``step()`` applies them."""
    if not opt._db.exchanged:
        opt._ensure_layout()
        exchange(opt, scale=1.0)


def step(opt: MultiNodeOptimizer) -> None:
    """Send this step's gradients (unless ``synchronize()`` did), apply the previous step's."""
    scale = inverse_grad_scale(opt)
    if not opt._db.exchanged:
        if opt._skip_sync:
            raise opt._not_synchronized_error()
        if not (
            getattr(opt, "found_inf", None) is not None and getattr(opt, "grad_scale", None) is None
        ):
            opt._check_no_local_writes()  # (GradScaler.unscale_ writes them: allowed)
        opt._guard.clear()
        opt._ensure_layout()
        exchange(opt, scale)
    elif scale != 1.0:
        raise RuntimeError(
            "with double_buffering and GradScaler, call scaler.unscale_(optimizer) before "
            "optimizer.synchronize(): the gradients were sent still scaled"
        )
    if opt._comp is not None:
        opt._comp.restore()  # the stale average is applied at the true weights
    apply_result(opt, opt._db.take())
    if opt._comp is not None:
        pending = opt._db.pending  # this step's reduction: its local NaN/Inf flags
        local_bad = pending is not None and any(bool(b) for b in pending._bad if b is not None)
        opt._comp.predict(local_bad, opt.clip_grad_norm)


def flush(opt: MultiNodeOptimizer) -> None:
    """Apply the last pending averages, leaving the model at its true weights."""
    if opt._db.pending is None:
        if opt._comp is not None:
            opt._comp.restore()
        return
    with opt._own_reads():
        if opt._comp is not None:
            opt._comp.local = None
            opt._comp.restore()  # the model keeps the true weights from here on
        apply_result(opt, opt._db.flush(opt.zero_fill))
