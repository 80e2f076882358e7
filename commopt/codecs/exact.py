"""The codec for "no codec": a buffer travels exactly, in its own dtype.

Not registered under a name (``get_codec`` knows the user-facing codecs): the collectives
build one per buffer dtype when they are given ``codec=None``.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

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

    def encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        scale: float = 1.0,
        rng: RngKey | None = None,
        key: Hashable | None = None,
    ) -> None:
        dst = out.view(self.wire_dtype)[: x.numel()]
        if scale == 1.0:
            dst.copy_(x)
        else:
            torch.mul(x, scale, out=dst)

    def decode(self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False) -> None:
        src = wire.view(self.wire_dtype)[: out.numel()]
        if accumulate:
            out.add_(src)
        else:
            out.copy_(src)
