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
"""
from __future__ import annotations

from typing import Any, Hashable

import torch

from commopt.codecs._wire import check_values
from commopt.codecs.base import Codec, RngKey


class ErrorFeedback(Codec):
    """Wrap ``inner`` with a residual per key. ``inner`` is exposed for re-encoding."""

    def __init__(self, inner: Codec):
        if isinstance(inner, ErrorFeedback):
            raise ValueError("ErrorFeedback(ErrorFeedback(...)) makes no sense; wrap the codec once")
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
        if r is None:
            r = flat * scale if scale != 1.0 else flat.clone()
        else:
            if r.numel() != flat.numel():
                raise ValueError(
                    f"{self.name}: key {key!r} had {r.numel()} elements before and {flat.numel()} "
                    "now; give each tensor/bucket its own key (or call reset())"
                )
            if r.device != flat.device:
                r = r.to(flat.device)
            r.add_(flat, alpha=scale)
        self._residuals[key] = r
        self.inner.encode(r, out, scale=1.0, rng=rng, key=key)
        # r <- y - decode(wire), fused in the decode kernel
        self.inner.decode_scaled(out, r, accumulate=True, alpha=-1.0)
        torch.nan_to_num_(r, nan=0.0, posinf=0.0, neginf=0.0)

    def decode(self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False) -> None:
        self.inner.decode(wire, out, accumulate=accumulate)

    def decode_scaled(self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False,
                      alpha: float = 1.0) -> None:
        self.inner.decode_scaled(wire, out, accumulate=accumulate, alpha=alpha)

    def residual(self, key: Hashable | None = None) -> torch.Tensor | None:
        """The residual kept for ``key`` (None before its first encode)."""
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = ..., /) -> None:
        """Forget the residual of ``key``, or of every key when called without one."""
        if key is ...:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

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

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"
