"""Applying a step's agreed result: the collective NaN/Inf skip, clipping, the inner step.

The reduction's trailer agrees on one :class:`~commopt.reducer.StepResult` on every rank,
so every rank takes the same decision here without communicating: a step where some rank
had NaN/Inf gradients is skipped everywhere (counted in ``skipped_steps``, logged by rank
0); otherwise ``clip_grad_norm=`` clips the averages and the inner optimizer steps.

    >>> import torch, commopt
    >>> from commopt.reducer import StepResult
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = commopt.create_multi_node_optimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1), commopt.create_communicator("local")
    ... )
    >>> apply_result(opt, StepResult(nonfinite=True, bad_buckets=[0], present=[True, True]))
    >>> opt.skipped_steps, opt.last_step_skipped, opt.applied_steps
    (1, True, 0)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from commopt.optim import clipping

if TYPE_CHECKING:
    from commopt.optim.multi_node import MultiNodeOptimizer
    from commopt.reducer import StepResult

__all__ = ["apply_result", "clip"]

log = logging.getLogger("commopt")


def apply_result(opt: MultiNodeOptimizer, result: StepResult | None) -> None:
    """Run the inner step unless some rank had NaN/Inf (``result``: None, nothing to apply)."""
    if result is None:
        opt.last_step_skipped = False
        return
    if result.nonfinite:
        opt.skipped_steps += 1
        opt.last_step_skipped = True
        if opt.comm.rank == 0:
            log.warning(
                "commopt: skipped step %d on every rank: NaN/Inf gradients on some rank "
                "(buckets %s); %d step(s) skipped so far",
                opt.applied_steps + opt.skipped_steps,
                result.bad_buckets,
                opt.skipped_steps,
            )
        return
    clip(opt)
    opt.inner.step()
    opt.applied_steps += 1
    opt.last_step_skipped = False


def clip(opt: MultiNodeOptimizer) -> None:
    """``clip_grad_norm=``: clip the averaged gradients about to be applied."""
    if opt.clip_grad_norm is not None:
        opt.last_grad_norm = clipping.clip_grad_norm(opt._layout.params, opt.clip_grad_norm)
