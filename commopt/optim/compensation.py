"""``double_buffering="compensated"``: the wrapper's side of :mod:`~commopt.optim.staleness`.

Plain double buffering applies step t's averaged gradient at ``w[t+1]``; compensated
double buffering moves each rank's model, between steps, to the weights its *local*
gradient predicts for the next step (:class:`~commopt.optim.staleness.LocalStepPrediction`),
so the next gradient is taken (nearly) where its average will be applied. This module
holds what the wrapper needs for that: taking this rank's local gradients as the step
sends them (a reference where the reduction replaces ``param.grad`` rather than writing
into it, else one copy), and the checkpoint part that differs per rank (the predicted
weights each rank's model holds between steps).

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([1.0, -2.0])
    >>> local = LocalGradients.take([w], [w], scale=1.0, keep_reference=lambda p: True)
    >>> local.grads[0].data_ptr() == w.grad.data_ptr()   # held, not copied
    True
    >>> [round(x, 3) for x in local.clipped(max_norm=1.0)[0].tolist()]   # as clip_grad_norm= would
    [0.447, -0.894]
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["LocalGradients", "COMPENSATED", "parse_mode"]

COMPENSATED = "compensated"


def parse_mode(double_buffering) -> tuple[bool, bool]:
    """``(double buffering on, compensated)`` from the wrapper's ``double_buffering=`` value."""
    if isinstance(double_buffering, str):
        if double_buffering != COMPENSATED:
            raise ValueError(f"double_buffering must be False, True or 'compensated', got "
                             f"{double_buffering!r}")
        return True, True
    return bool(double_buffering), False


class LocalGradients:
    """This rank's unscaled gradients of one step, one per parameter in ``param_groups`` order."""

    def __init__(self, grads: list[torch.Tensor | None]):
        self.grads = grads

    @classmethod
    def take(cls, all_params: Sequence[torch.Tensor], sent: Sequence[torch.Tensor], scale: float,
             keep_reference: Callable[[torch.Tensor], bool]) -> "LocalGradients":
        """Take the gradients of ``sent`` before the reduction starts.

        ``keep_reference(p)``: the reduction will *replace* ``p.grad`` (its averages land in
        a bucket view) and never writes into the tensor now there, so holding it is enough;
        otherwise the gradient is copied (it is a bucket view the reduction overwrites, or
        the averages will be copied into it). ``scale`` != 1 (GradScaler) makes a new,
        unscaled tensor anyway.
        """
        ours = {id(p) for p in sent}
        grads: list[torch.Tensor | None] = []
        for p in all_params:
            g = p.grad if id(p) in ours else None
            if g is None:
                grads.append(None)
            elif scale != 1.0:
                grads.append(g.detach().float() * scale)   # a new tensor: .grad is still to be sent
            elif g.dtype == torch.float32 and keep_reference(p):
                grads.append(g.detach())
            else:
                grads.append(g.detach().float().clone() if g.dtype == torch.float32 else g.detach().float())
        return cls(grads)

    def clipped(self, max_norm: float | None) -> list[torch.Tensor | None]:
        """The gradients as ``clip_grad_norm=`` would clip them (new tensors only if clipped)."""
        present = [g for g in self.grads if g is not None]
        if max_norm is None or not present:
            return self.grads
        norm = float(torch.nn.utils.get_total_norm(present))
        coef = max_norm / (norm + 1e-6)
        if not coef < 1.0:
            return self.grads
        return [None if g is None else g * coef for g in self.grads]


def own_state(comp, params: Sequence[torch.Tensor], aside: list[torch.Tensor] | None) -> dict[str, Any]:
    """What this rank checkpoints of the prediction: the predicted weights its model holds.

    They differ per rank (each predicts from its own local gradient), so they travel with
    the rank's own state, not the replicated part; ``aside`` is where they are kept while
    ``true_weights()`` is active.
    """
    if not comp.predicting:
        return {"predicted": None}
    current = aside if aside is not None else params
    return {"predicted": [p.detach().clone() for p in current]}
