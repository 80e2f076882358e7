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
from typing import Any

import torch

from commopt.comm.base import Communicator, scalar_device

__all__ = ["average_loss", "step_with_closure"]


def step_with_closure(
    inner: torch.optim.Optimizer,
    comm: Communicator,
    closure: Callable[[], Any],
    *,
    discard: Callable[[], None],
    synchronize: Callable[[], None],
    clip: Callable[[], None],
) -> Any:
    """``inner.step(closure)`` where every closure call returns averaged loss and gradients.

    Before each evaluation ``discard()`` forgets the previous one's gradients; after it,
    ``synchronize()`` averages the new ones and ``clip()`` clips them (``clip_grad_norm=``).
    """

    def averaged_closure() -> Any:
        discard()  # the previous evaluation's gradients are consumed
        with torch.enable_grad():
            loss = closure()
        synchronize()
        clip()
        return average_loss(comm, loss)

    loss = inner.step(averaged_closure)
    discard()
    return loss


def average_loss(comm: Communicator, loss: Any) -> Any:
    """The mean of ``loss`` over the ranks (same type back: tensor or number; None stays)."""
    if loss is None or comm.size == 1:
        return loss
    value = torch.tensor(
        [float(loss.detach() if isinstance(loss, torch.Tensor) else loss)],
        dtype=torch.float64,
        device=scalar_device(comm),
    )
    comm.allreduce(value)
    mean = value.item() / comm.size
    if isinstance(loss, torch.Tensor):
        return torch.tensor(mean, dtype=loss.dtype, device=loss.device)
    return mean
