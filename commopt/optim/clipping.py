"""Gradient clipping and ``.grad`` writes: what the multi-node wrapper does about them.

``.grad`` holds this rank's *local* gradients until the reduction lands (``overlap=False``
and double buffering keep them local until ``step()``), so a clip or scale written there
would change the local gradients only, or be overwritten by the averages. The wrapper
offers two ways that clip the averaged gradients: its own ``clip_grad_norm=`` option
(:func:`clip_grad_norm`, applied to the gradients the inner step uses) and Horovod's
``synchronize()`` / ``skip_synchronize()`` pattern. :class:`GradWriteGuard` catches the
third way, a write before the reduction, through the tensors' version counters (every
in-place operation bumps them; reading one costs nothing), so it fails loudly instead.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm([w], max_norm=1.0)  # returns the norm before clipping (a tensor)
    tensor(5.)
    >>> [round(x, 3) for x in w.grad.tolist()]
    [0.6, 0.8]
    >>> guard = GradWriteGuard(); guard.record([w])
    >>> guard.written([w], ["w"])
    []
    >>> _ = w.grad.mul_(0.5)  # what clip_grad_norm_ does
    >>> guard.written([w], ["w"])
    ['w']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["GradWriteGuard", "check_max_norm", "clip_grad_norm", "write_before_reduction_error"]


def check_max_norm(max_norm: Any) -> float | None:
    """``clip_grad_norm=`` as a float (None: no clipping); a ValueError for anything else."""
    if max_norm is None:
        return None
    try:
        value = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(
            f"clip_grad_norm must be a positive number or None, got {max_norm!r}"
        ) from None
    if not value > 0 or math.isinf(value):
        raise ValueError(
            f"clip_grad_norm must be a positive, finite number (the largest global "
            f"L2 norm of the averaged gradient), got {max_norm!r}"
        )
    return value


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor | float:
    """Scale the gradients of ``params`` in place so their global L2 norm is at most ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_`` over the gradients present; returns the norm before
    clipping as a 0-dim tensor on the gradients' device, never read on the host (NaN/Inf
    when a gradient is not finite; then nothing useful can be clipped). 0.0: no gradient.
    Called on averaged gradients, which are identical on every rank, it takes the same
    decision on every rank without any communication.
    """
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return torch.nn.utils.clip_grad_norm_(grads, max_norm)


class GradWriteGuard:
    """Notices writes to ``param.grad`` between :meth:`record` and :meth:`written`.

    Records each gradient tensor and its version counter. A gradient replaced
    (``p.grad = ...``) or changed in place (``clip_grad_norm_``, ``mul_``) shows up as a
    different tensor or version. Gradients that are views of one bucket share a counter,
    so one write flags every gradient of that bucket: the names are of the bucket.
    """

    def __init__(self) -> None:
        self._recorded: list[tuple[torch.Tensor, int] | None] | None = None

    def record(self, params: Sequence[torch.Tensor]) -> None:
        """Remember the current gradients (end of backward)."""
        self._recorded = [None if p.grad is None else (p.grad, p.grad._version) for p in params]

    def clear(self) -> None:
        """Forget the record (the gradients were reduced: writes are fine from now on)."""
        self._recorded = None

    def written(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> list[str]:
        """Names of the parameters whose gradient changed since :meth:`record` (none recorded: [])."""
        if self._recorded is None or len(self._recorded) != len(params):
            return []
        out = []
        for p, rec, name in zip(params, self._recorded, names):
            g = p.grad
            if rec is None:
                if g is not None:
                    out.append(name)
            elif g is None or g is not rec[0] or g._version != rec[1]:
                out.append(name)
        return out


def write_before_reduction_error(names: list[str], mode: str) -> RuntimeError:
    """The error for a ``.grad`` write before the reduction, naming both fixes."""
    shown = ", ".join(repr(n) for n in names[:3]) + (
        f" and {len(names) - 3} more" if len(names) > 3 else ""
    )
    return RuntimeError(
        f"the gradient of {shown} was changed after backward() but before commopt averaged it "
        f"across ranks (e.g. by torch.nn.utils.clip_grad_norm_ or an in-place scale). With "
        f"{mode}, param.grad holds this rank's local gradients until step() averages them, so "
        "the change would apply to one rank's gradients, not to the average. Either call "
        "optimizer.synchronize() first (param.grad then holds the averaged gradients), change "
        "them, and step with `with optimizer.skip_synchronize(): optimizer.step()`; or let "
        "commopt clip the averaged gradients: create_multi_node_optimizer(..., "
        "clip_grad_norm=MAX_NORM)."
    )
