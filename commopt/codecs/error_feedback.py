"""Error feedback: carry what the wrapped codec lost into the next encode of the same key.

For each ``key`` (the reducer passes a stable bucket id) the wrapper keeps the residual
``r``; ``encode`` sends ``y = x * scale + r`` through the inner codec and keeps
``r = y - decode(encode(y))``. Over steps the errors then cancel instead of adding up.
The residual lives in the scaled ("sent") domain and is part of ``state_dict``.

    >>> import torch
    >>> from commopt.codecs import ErrorFeedback, QSGD, RngKey
    >>> ef = ErrorFeedback(QSGD(bits=2, bucket_size=4, stochastic=False))
    >>> x = torch.tensor([1.0, 0.4, 0.3, 0.0])
    >>> wire = torch.empty(ef.encoded_nbytes(4), dtype=torch.uint8)
    >>> ef.encode(x, wire, key="layer1")
    >>> sent = torch.zeros(4); ef.decode(wire, sent)
    >>> sent.tolist(), ef.residual("layer1").tolist()
    ([1.0, 0.0, 0.0, 0.0], [0.0, 0.4000000059604645, 0.30000001192092896, 0.0])

A non-finite input is sent as is (the optimizer's check sees it) but is not carried: the
residual entries it touches are reset to zero, so one bad step cannot poison later ones.

Steps that may be undone: between ``begin_step()`` and the next ``begin_step()``, each key's
first encode writes its new residual into a second buffer and keeps the old one, so
``discard_step()`` puts every residual back exactly as it was (the optimizer does this when
every rank skips a step for NaN/Inf: the healthy ranks' residuals must not keep a gradient
that was never applied). Costs one more residual-sized buffer per key, no extra pass.

    >>> ef.begin_step(); ef.encode(torch.tensor([0.0, 9.0, 0.0, 0.0]), wire, key="layer1")
    >>> ef.discard_step(); ef.residual("layer1").tolist()
    [0.0, 0.4000000059604645, 0.30000001192092896, 0.0]
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from commopt.codecs._wire import check_values
from commopt.codecs.base import Codec, RngKey
from commopt.codecs.lowrank import PowerSGD


class ErrorFeedback(Codec):
    """Wrap ``inner`` with a residual per key. ``inner`` is exposed for re-encoding."""

    def __init__(self, inner: Codec):
        if isinstance(inner, ErrorFeedback):
            raise ValueError(
                "ErrorFeedback(ErrorFeedback(...)) makes no sense; wrap the codec once"
            )
        if isinstance(inner, PowerSGD):
            raise ValueError(
                f"{inner.name} keeps its own error feedback; use it unwrapped "
                "(PowerSGD(..., error_feedback=False) turns it off)"
            )
        if not isinstance(inner, Codec):
            raise TypeError(f"ErrorFeedback wraps a Codec, got {type(inner).__name__}")
        self.inner = inner
        self.name = f"{inner.name}+ef"
        self.linear = inner.linear
        self.wire_dtype = inner.wire_dtype
        self.alignment = inner.alignment
        self.stochastic = inner.stochastic
        self.can_overflow = inner.can_overflow
        self._residuals: dict[Hashable, torch.Tensor] = {}
        # The open step (begin_step): each key's residual before it (None: the key was new).
        self._before: dict[Hashable, torch.Tensor | None] | None = None
        self._spare: dict[Hashable, torch.Tensor] = {}  # buffers the next step writes into

    def encoded_nbytes(self, numel: int) -> int:
        return self.inner.encoded_nbytes(numel)

    def encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        scale: float = 1.0,
        rng: RngKey | None = None,
        key: Hashable | None = None,
    ) -> None:
        flat = check_values(self, x, "x")
        r = self._residuals.get(key)
        keep = self._before is not None and key not in self._before  # first encode this step
        if r is None:
            r = flat * scale if scale != 1.0 else flat.clone()
        else:
            if r.numel() != flat.numel():
                raise ValueError(
                    f"{self.name}: key {key!r} had {r.numel()} elements before and {flat.numel()} "
                    "now; give each tensor/bucket its own key (or call reset())"
                )
            old = r
            if r.device != flat.device:
                r = r.to(flat.device)
            if keep:  # the same addition, into another buffer: the old residual stays intact
                spare = self._spare.pop(key, None)
                if spare is None or spare.shape != r.shape or spare.device != r.device:
                    spare = torch.empty_like(r)
                r = torch.add(r, flat, alpha=scale, out=spare)
            else:
                r.add_(flat, alpha=scale)
            if keep and self._before is not None:
                self._before[key] = old
        if keep and self._before is not None and key not in self._before:
            self._before[key] = None
        self._residuals[key] = r
        self.inner.encode(r, out, scale=1.0, rng=rng, key=key)
        # r <- y - decode(wire), fused in the decode kernel
        self.inner.decode_own(out, r, accumulate=True, alpha=-1.0)
        torch.nan_to_num_(r, nan=0.0, posinf=0.0, neginf=0.0)

    def decode(self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False) -> None:
        self.inner.decode(wire, out, accumulate=accumulate)

    def decode_scaled(
        self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0
    ) -> None:
        self.inner.decode_scaled(wire, out, accumulate=accumulate, alpha=alpha)

    def decode_own(
        self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0
    ) -> None:
        self.inner.decode_own(wire, out, accumulate=accumulate, alpha=alpha)

    def residual(self, key: Hashable | None = None) -> torch.Tensor | None:
        """The residual kept for ``key`` (None before its first encode)."""
        return self._residuals.get(key)

    def begin_step(self) -> None:
        """Open a step that :meth:`discard_step` can undo (the open one becomes final)."""
        for key, old in (self._before or {}).items():
            if old is not None:
                self._spare[key] = old
        self._before = {}

    def discard_step(self) -> None:
        """Put every residual back as it was at :meth:`begin_step` (the step never happened)."""
        for key, old in (self._before or {}).items():
            new = self._residuals.pop(key, None)
            if old is not None:
                self._residuals[key] = old
            if new is not None:
                self._spare[key] = new
        if self._before is not None:
            self._before = {}

    def reset(self, key: Hashable | None = ..., /) -> None:
        """Forget the residual of ``key``, or of every key when called without one."""
        if key is ...:
            self._residuals.clear()
            self._spare.clear()
            if self._before is not None:
                self._before = {}
        else:
            self._residuals.pop(key, None)
            self._spare.pop(key, None)
            if self._before is not None:
                self._before.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": dict(self._residuals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"residuals"}
        if unknown:
            raise ValueError(f"{self.name}: unexpected state keys {sorted(unknown)}")
        residuals = state.get("residuals", {})
        for key, value in residuals.items():
            if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
                raise TypeError(f"{self.name}: residual {key!r} must be a float32 tensor")
        self._residuals = {key: value.detach().clone().view(-1) for key, value in residuals.items()}
        self._spare.clear()
        if self._before is not None:
            self._before = {}  # the loaded state is final: nothing to undo

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"
