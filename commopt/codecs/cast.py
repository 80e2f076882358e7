"""Cast codecs: the wire is the buffer itself in float32, float16 or bfloat16.

``encode`` multiplies by ``scale`` before rounding (to nearest even), so dividing by the
world size there keeps a 16-bit sum of all ranks inside the float16 range. The wires are
linear: a transport may sum them as ``wire.view(codec.wire_dtype)``; when commopt sums them
itself it decodes into float32 (``decode(..., accumulate=True)``), so only the wire has 16
bits, never the accumulator.

    >>> import torch
    >>> codec = CastCodec(torch.bfloat16)
    >>> x = torch.tensor([1.0, 3.0])
    >>> wire = torch.empty(codec.encoded_nbytes(2), dtype=torch.uint8)
    >>> codec.encode(x, wire, scale=0.5)
    >>> out = torch.ones(2)
    >>> codec.decode(wire, out, accumulate=True)
    >>> out.tolist()
    [1.5, 2.5]

Values beyond the float16 range (65504 after scaling) become +-Inf and NaN stays NaN: the
non-finite value reaches the decoded gradient, where the optimizer's check catches it. The
same holds for a damaged wire whose bytes spell NaN or Inf: ``can_overflow`` is True for
every cast, so a reduction through one re-checks its result.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from commopt import kernels
from commopt.codecs._wire import check_values, check_wire, typed_view
from commopt.codecs.base import Codec, RngKey

_NAMES = {torch.float32: "none", torch.float16: "fp16", torch.bfloat16: "bf16"}


class CastCodec(Codec):
    """Send the values as ``dtype`` (float32, float16 or bfloat16)."""

    linear = True
    alignment = 1
    stochastic = False

    def __init__(self, dtype: torch.dtype = torch.float16):
        if not isinstance(dtype, torch.dtype) or dtype not in _NAMES:
            raise ValueError(f"CastCodec dtype must be one of {list(_NAMES)}, got {dtype}")
        self.dtype = dtype
        self.wire_dtype = dtype
        self.name = _NAMES[dtype]
        # float16 overflows at 65504; and any damaged wire can hold NaN/Inf bit patterns
        self.can_overflow = True
        self._itemsize = torch.empty((), dtype=dtype).element_size()

    def encoded_nbytes(self, numel: int) -> int:
        return int(numel) * self._itemsize

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
        check_wire(self, out, flat.numel(), "output")
        typed = typed_view(out, self.dtype)
        if typed is not None:
            kernels.cast_encode(flat, typed, scale=scale)
            return
        tmp = torch.empty(flat.numel(), dtype=self.dtype, device=flat.device)
        kernels.cast_encode(flat, tmp, scale=scale)
        out.copy_(tmp.view(torch.uint8))

    def decode(self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False) -> None:
        self.decode_scaled(wire, out, accumulate=accumulate)

    def decode_scaled(
        self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0
    ) -> None:
        flat = check_values(self, out, "out")
        check_wire(self, wire, flat.numel(), "wire")
        typed = typed_view(wire, self.dtype)
        if typed is None:
            typed = wire.clone().view(self.dtype)
        kernels.cast_decode(typed, flat, accumulate=accumulate, alpha=alpha)

    def __repr__(self) -> str:
        return f"CastCodec({self.dtype})"


class NoneCodec(CastCodec):
    """No compression: float32 on the wire (the baseline every other codec is measured by)."""

    def __init__(self) -> None:
        super().__init__(torch.float32)

    def __repr__(self) -> str:
        return "NoneCodec()"
