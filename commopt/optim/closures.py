"""``step(closure)``: closure optimizers (LBFGS) over many ranks.

The closure re-evaluates the loss and its gradients (LBFGS calls it several times per
step). Each call's gradients are averaged over the ranks before the inner optimizer reads
them, and so is the loss it returns, so that every rank takes the same line-search and
convergence decisions (the same number of closure calls: otherwise the ranks would wait on
each other forever).

    >>> import torch, commopt
    >>> comm = commopt.create_communicator("local")
    >>> average_loss(comm, torch.tensor(2.0)), average_loss(comm, None)
    (tensor(2.), None)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from commopt.comm.base import Communicator
from commopt.optim.apply_step import clip

if TYPE_CHECKING:
    from commopt.optim.multi_node import MultiNodeOptimizer

__all__ = ["average_loss", "step_with_closure"]


def step_with_closure(opt: MultiNodeOptimizer, closure: Callable[[], Any]) -> Any:
    """``opt.inner.step(closure)`` where every closure call returns averaged loss and gradients."""
    if opt.double_buffering:
        raise ValueError(
            "step(closure) re-evaluates the gradients within the step, which double "
            "buffering (gradients applied one step late) cannot do: create the optimizer "
            "with double_buffering=False for closure optimizers such as LBFGS"
        )
    if opt._skip_sync:
        raise RuntimeError(
            "step(closure) inside skip_synchronize(): the closure's gradients "
            "are averaged by step() itself; call step(closure) outside it"
        )

    def averaged_closure():
        opt._step.drop()  # the previous evaluation's gradients are consumed
        opt._guard.clear()
        with torch.enable_grad():
            loss = closure()
        opt.synchronize()
        clip(opt)
        return average_loss(opt.comm, loss)

    loss = opt.inner.step(averaged_closure)
    opt._step.drop()
    opt.applied_steps += 1
    opt.last_step_skipped = False
    return loss


def average_loss(comm: Communicator, loss: Any) -> Any:
    """The mean of ``loss`` over the ranks (same type back: tensor or number; None stays)."""
    if loss is None or comm.size == 1:
        return loss
    value = torch.tensor(
        [float(loss.detach() if isinstance(loss, torch.Tensor) else loss)], dtype=torch.float64
    )
    comm.allreduce(value)
    mean = value.item() / comm.size
    if isinstance(loss, torch.Tensor):
        return torch.tensor(mean, dtype=loss.dtype, device=loss.device)
    return mean
