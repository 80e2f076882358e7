"""The codec for "no codec": a buffer travels exactly, in its own dtype.

Not registered under a name (``get_codec`` knows the user-facing codecs): the collectives
build one per buffer dtype when they are given ``codec=None``. Like every codec it checks the
wire's dtype and size before reading it (a wrong size is a ``ValueError``, never a short read
or a broadcast).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from commopt.codecs._wire import check_wire, typed_view
from commopt.codecs.base import Codec, RngKey

__all__ = ["Exact"]


class Exact(Codec):
    """Identity codec over any dtype: what the collectives use when ``codec`` is None.

    >>> import torch
    >>> from commopt.codecs.exact import Exact
    >>> codec, x = Exact(torch.float64), torch.tensor([1.5, -2.0], dtype=torch.float64)
    >>> wire = torch.empty(codec.encoded_nbytes(2), dtype=torch.uint8)
    >>> codec.encode(x, wire, scale=2.0); out = torch.empty_like(x)
    >>> codec.decode(wire, out); out.tolist()
    [3.0, -4.0]
    """

    name = "exact"
    linear = True
    wire_dtype: torch.dtype

    def __init__(self, dtype: torch.dtype):
        self.wire_dtype = dtype
        self._itemsize = torch.empty((), dtype=dtype).element_size()

    def encoded_nbytes(self, numel: int) -> int:
        return numel * self._itemsize

    def _typed(self, wire: torch.Tensor, t: torch.Tensor, what: str) -> torch.Tensor:
        """``wire`` as ``wire_dtype`` after checking it against ``t`` (raises when they differ)."""
        if t.dtype != self.wire_dtype:
            raise TypeError(f"exact: {what} must be {self.wire_dtype}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"exact: {what} must be contiguous")
        check_wire(self, wire, t.numel(), "wire" if what == "out" else "output")
        typed = typed_view(wire, self.wire_dtype)
        return wire.clone().view(self.wire_dtype) if typed is None else typed

    def encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        scale: float = 1.0,
        rng: RngKey | None = None,
        key: Hashable | None = None,
    ) -> None:
        dst = self._typed(out, x, "x")
        if dst.data_ptr() != out.data_ptr():  # ``out`` sits at an odd offset: write bytes
            dst = torch.empty_like(dst)
        if scale == 1.0:
            dst.copy_(x.view(-1))
        else:
            torch.mul(x.view(-1), scale, out=dst)
        if dst.data_ptr() != out.data_ptr():
            out.copy_(dst.view(torch.uint8))

    def decode(self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False) -> None:
        src = self._typed(wire, out, "out").view(out.shape)
        if accumulate:
            out.add_(src)
        else:
            out.copy_(src)
