"""Applying a step's agreed result: the collective NaN/Inf skip, clipping, the inner step.

The reduction's trailer agrees on one :class:`~commopt.reducer.StepResult` on every rank,
so every rank takes the same decision here without communicating: a step where some rank
had NaN/Inf gradients is skipped everywhere (counted in ``skipped_steps``, logged by rank
0); otherwise ``clip_grad_norm=`` clips the averages and the inner optimizer steps.
:class:`StepApplier` owns that decision and its counters.

    >>> import torch
    >>> from commopt.reducer import StepResult
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> applier = StepApplier(torch.optim.SGD([w], lr=0.1), rank=0, clip_grad_norm=None)
    >>> applier.apply(StepResult(nonfinite=True, bad_buckets=[0], present=[True]), [w])
    >>> applier.skipped_steps, applier.last_step_skipped, applier.applied_steps
    (1, True, 0)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from commopt.optim import clipping

if TYPE_CHECKING:
    from commopt.reducer import StepResult

__all__ = ["StepApplier", "inverse_grad_scale"]

log = logging.getLogger("commopt")


def inverse_grad_scale(grad_scale: Any) -> float | torch.Tensor:
    """1 / GradScaler's scale when GradScaler drives this step (``grad_scale`` None: 1).

    GradScaler's scale is a tensor on the gradients' device: its inverse stays there (a
    0-dim float64 tensor the reduction multiplies by on the device; never read on the host).
    """
    if grad_scale is None:
        return 1.0
    if isinstance(grad_scale, torch.Tensor):
        return torch.reciprocal(grad_scale.detach().to(torch.float64))
    return 1.0 / float(grad_scale)


class StepApplier:
    """The inner step behind the NaN/Inf skip and clipping, and the step counters."""

    def __init__(
        self, inner: torch.optim.Optimizer, *, rank: int, clip_grad_norm: float | None
    ) -> None:
        self.inner = inner
        self.rank = rank
        self.clip_grad_norm = clipping.check_max_norm(clip_grad_norm)
        self.applied_steps = 0
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.last_grad_norm: float | torch.Tensor | None = None  # before clipping

    def apply(self, result: StepResult | None, params: Sequence[torch.Tensor]) -> None:
        """Run the inner step unless some rank had NaN/Inf (``result``: None, nothing to apply).

        ``params``: the parameters whose averaged gradients this step applies (clipped together).
        """
        if result is None:
            self.last_step_skipped = False
            return
        if result.nonfinite:
            self.skipped_steps += 1
            self.last_step_skipped = True
            if self.rank == 0:
                log.warning(
                    "commopt: skipped step %d on every rank: NaN/Inf gradients on some rank "
                    "(buckets %s); %d step(s) skipped so far",
                    self.applied_steps + self.skipped_steps,
                    result.bad_buckets,
                    self.skipped_steps,
                )
            return
        self.clip(params)
        self.inner.step()
        self.applied_steps += 1
        self.last_step_skipped = False

    def clip(self, params: Sequence[torch.Tensor]) -> None:
        """``clip_grad_norm=``: clip the averaged gradients about to be applied."""
        if self.clip_grad_norm is not None:
            self.last_grad_norm = clipping.clip_grad_norm(params, self.clip_grad_norm)

    @staticmethod
    def unscale(params: Sequence[torch.Tensor], scale: Any) -> None:
        """Divide the gradients of ``params`` by GradScaler's ``scale``, on the device.

        GradScaler handed its scale over (a part unscales locally), so the averages of the
        parts that do not are still scaled.
        """
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            inverse = inverse_grad_scale(scale)
            if isinstance(inverse, torch.Tensor):
                torch._foreach_mul_(grads, inverse.to(grads[0].dtype))
            else:
                torch._foreach_mul_(grads, inverse)

    def counted_closure_step(self) -> None:
        """A ``step(closure)`` ran the inner step (closures are never skipped)."""
        self.applied_steps += 1
        self.last_step_skipped = False

    def state_dict(self) -> dict[str, Any]:
        return {"applied_steps": self.applied_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.applied_steps = int(state["applied_steps"])
        self.skipped_steps = int(state["skipped_steps"])
