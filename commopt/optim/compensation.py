"""``double_buffering="compensated"``: the wrapper's side of :mod:`~commopt.optim.staleness`.

Plain double buffering applies step t's averaged gradient at ``w[t+1]``; compensated
double buffering moves each rank's model, between steps, to the weights its *local*
gradient predicts for the next step (:class:`~commopt.optim.staleness.LocalStepPrediction`),
so the next gradient is taken (nearly) where its average will be applied. This module
holds what the wrapper needs for that: taking this rank's local gradients as the step
sends them (a reference where the reduction replaces ``param.grad`` rather than writing
into it, else one copy), the ``true_weights()`` block, and the checkpoint parts: the true
weights (the same on every rank) and the predicted weights each rank's model holds between
steps (its own).

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([1.0, -2.0])
    >>> local = LocalGradients.take([w], [w], scale=1.0, keep_reference=lambda p: True)
    >>> local.grads[0].data_ptr() == w.grad.data_ptr()  # held, not copied
    True
    >>> [round(x, 3) for x in local.clipped(max_norm=1.0)[0].tolist()]  # as clip_grad_norm= would
    [0.447, -0.894]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from commopt.optim.staleness import LocalStepPrediction

if TYPE_CHECKING:
    from commopt.reducer import GradientReducer

__all__ = [
    "Compensation",
    "LocalGradients",
    "refuse_prediction",
    "unpack_replaces_grad",
]


class LocalGradients:
    """This rank's unscaled gradients of one step, one per parameter in ``param_groups`` order."""

    def __init__(self, grads: list[torch.Tensor | None]):
        self.grads = grads

    @classmethod
    def take(
        cls,
        all_params: Sequence[torch.Tensor],
        sent: Sequence[torch.Tensor],
        scale: float | torch.Tensor,
        keep_reference: Callable[[torch.Tensor], bool],
    ) -> LocalGradients:
        """Take the gradients of ``sent`` before the reduction starts.

        ``keep_reference(p)``: the reduction will *replace* ``p.grad`` (its averages land in
        a bucket view) and never writes into the tensor now there, so holding it is enough;
        otherwise the gradient is copied (it is a bucket view the reduction overwrites, or
        the averages will be copied into it). A ``scale`` (GradScaler's inverse scale, a 0-dim
        tensor, or a number other than 1) makes a new, unscaled tensor anyway.
        """
        ours = {id(p) for p in sent}
        grads: list[torch.Tensor | None] = []
        for p in all_params:
            g = p.grad if id(p) in ours else None
            if g is None:
                grads.append(None)
            elif isinstance(scale, torch.Tensor) or scale != 1.0:
                grads.append(g.detach().float() * scale)  # a new tensor: .grad is still to be sent
            elif g.dtype == torch.float32 and keep_reference(p):
                grads.append(g.detach())
            else:
                grads.append(
                    g.detach().float().clone() if g.dtype == torch.float32 else g.detach().float()
                )
        return cls(grads)

    def clipped(self, max_norm: float | None) -> list[torch.Tensor | None]:
        """The gradients as ``clip_grad_norm=`` would clip them (new tensors only if clipped)."""
        present = [g for g in self.grads if g is not None]
        if max_norm is None or not present:
            return self.grads
        # As torch.nn.utils.clip_grad_norm_ computes it, on the device (no host read).
        norm = torch.nn.utils.get_total_norm(present)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return [None if g is None else g * coef for g in self.grads]


def unpack_replaces_grad(reducer: GradientReducer) -> Callable[[torch.Tensor], bool]:
    """``f(p)``: unpacking points ``p.grad`` at its bucket, leaving the tensor now there alone.

    False for a gradient that is a bucket view (the reduction overwrites it) and for a
    parameter whose averages are copied into its ``.grad`` (dtype differs from the bucket's):
    :meth:`LocalGradients.take` keeps a reference where this is True, else a copy.
    """
    index = {id(q): i for i, q in enumerate(reducer.params)}
    storages = {f.untyped_storage().data_ptr() for buffers in reducer.buffers for f in buffers}

    def replaces(p: torch.Tensor) -> bool:
        flat = reducer.buffers[0][reducer.bucket_of[index[id(p)]]]
        return (
            p.grad is not None
            and p.grad.untyped_storage().data_ptr() not in storages
            and reducer.viewable(p, flat)
        )

    return replaces


class Compensation:
    """The wrapper's compensated-double-buffering state: the prediction and this step's gradients.

    ``optimizer`` is the inner optimizer (a TypeError naming ``double_buffering="stale"`` for
    one whose update rule cannot be predicted).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.prediction = LocalStepPrediction(optimizer)
        self.local: LocalGradients | None = None  # this step's local gradients, sent
        self.aside: list[torch.Tensor] | None = None  # predicted weights, inside true_weights()

    def _params(self) -> list[torch.Tensor]:
        return self.prediction.tensors()

    def restore(self) -> None:
        """Put the true weights back (before an average is applied, a flush, a re-broadcast)."""
        if self.aside is not None:
            raise RuntimeError(
                "optimizer.step() or flush() inside `with optimizer.true_weights():`: "
                "evaluate inside the block, step outside it"
            )
        self.prediction.restore()

    def predict(self, step_skipped_here: bool | torch.Tensor, max_norm: float | None) -> None:
        """Move the model to the weights this step's local gradients predict (once per step).

        ``step_skipped_here``: this rank's NaN/Inf flag of the step sent (no local step then).
        A tensor flag is never read on the host: the predicted step is masked to zero where
        it is set (the model keeps the true weights' values; the prediction still counts as
        made, so ``true_weights()`` and the checkpoint hold the true weights aside).
        """
        local, self.local = self.local, None
        if local is None or step_skipped_here is True:
            return  # nothing sent, or NaN/Inf here: no local step either
        skip = step_skipped_here if isinstance(step_skipped_here, torch.Tensor) else None
        self.prediction.predict(local.clipped(max_norm), skip=skip)

    @contextlib.contextmanager
    def true_weights(self) -> Iterator[None]:
        if not self.prediction.predicting or self.aside is not None:
            yield
            return
        params = self._params()
        with torch.no_grad():
            self.aside = [p.detach().clone() for p in params]
            weights = self.prediction.weights
            assert weights is not None  # predicting: the true weights are kept aside
            torch._foreach_copy_(params, weights)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, self.aside)
            self.aside = None

    # -- checkpoint --------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """``compensated``: the true weights (the same on every rank); ``predicted``: the
        weights this rank's model holds (its own: ``split_rank_state`` puts them per rank)."""
        predicted = None
        if self.prediction.predicting:
            current = self.aside if self.aside is not None else self._params()
            predicted = [p.detach().clone() for p in current]
        return {"compensated": self.prediction.state_dict(), "predicted": predicted}

    def load(self, extra: dict[str, Any], rank: int) -> None:
        """Restore :meth:`state`'s keys from the optimizer's ``"commopt"`` state."""
        self.local = None
        saved = extra.get("compensated")
        if saved is None or saved.get("weights") is None:
            self.prediction.load_state_dict(saved if saved is not None else {"weights": None})
            return
        predicted = extra.get("predicted")
        if predicted is None:
            raise ValueError(
                f"rank {rank}: the checkpoint holds the true weights of compensated "
                "double buffering but not this rank's predicted weights: load the "
                "state this rank saved (its own part)"
            )
        self.prediction.load_state_dict(saved)
        params = self._params()
        if len(predicted) != len(params):
            raise ValueError(
                "the checkpoint's predicted weights do not match this model's parameters"
            )
        with torch.no_grad():
            torch._foreach_copy_(
                params, [w.to(p.device, p.dtype) for w, p in zip(predicted, params)]
            )


def refuse_prediction(extra: dict[str, Any]) -> None:
    """Raise when a non-compensated optimizer is given a checkpoint taken between compensated steps."""
    saved = extra.get("compensated")
    if saved is not None and saved.get("weights") is not None:
        raise ValueError(
            "the checkpoint was saved with double_buffering='compensated' between "
            "steps: load it into an optimizer created with "
            "double_buffering='compensated' (or call flush() before saving)"
        )
