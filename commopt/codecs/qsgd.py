"""QSGD: per-bucket scale plus a stochastically rounded sign+level code per element.

Each bucket of ``bucket_size`` consecutive elements (one tensor's elements only: the
reducer aligns tensors to ``alignment``) gets a level spacing ``step = norm / levels``
(``norm`` the max-abs or the l2 norm of the bucket, the quotient rounded up so that
``levels * step >= norm``). Element ``v`` becomes ``sign(v) * q`` with ``q`` in
``[0, levels]`` chosen between ``floor(|v| / step)`` and the level above by unbiased
stochastic rounding (or round to nearest with ``stochastic=False``); decoding gives
``sign * q * step``. Wire: the scales (float32, or float16 rounded up), then the codes
packed ``bits`` bits each, little-endian, zero padded to a multiple of 4 bytes. See
docs/codecs.md for the error bound and the random numbers.

    >>> import torch
    >>> from commopt.codecs import QSGD, RngKey
    >>> codec = QSGD(bits=4, bucket_size=128)
    >>> codec.encoded_nbytes(1024) / (1024 * 4)  # vs float32
    0.1328125
    >>> x = torch.randn(1000)
    >>> wire = torch.empty(codec.encoded_nbytes(1000), dtype=torch.uint8)
    >>> codec.encode(x, wire, rng=RngKey(seed=0, rank=0, reduction=0))
    >>> out = torch.zeros(1000)
    >>> codec.decode(wire, out)
    >>> bool(((out - x).abs() <= x.abs().max() / 7 * 1.0001).all())
    True

NaN or Inf in a bucket makes its scale non-finite, so every value decoded from that bucket
is NaN: a non-finite gradient is never hidden, and the optimizer's check reports it.

The wire is untrusted. ``decode`` of a CPU wire reads its scales first (one per bucket) and
raises ``ValueError`` naming the bucket for a scale no encoder writes: negative, or finite but
so large that ``levels`` steps overflow float32 (codec settings that differ between ranks, or
bytes damaged on the way). A NaN or Inf scale is how a NaN gradient travels, so it decodes as
NaN; ``can_overflow`` is True, so a reduction through QSGD re-checks its result and the step's
NaN/Inf agreement makes every rank skip the step even when only the wire was bad.

    >>> wire[:4] = torch.tensor([-1.0]).view(torch.uint8)  # bucket 0's scale, negative
    >>> codec.decode(wire, out)
    Traceback (most recent call last):
    ...
    ValueError: qsgd4: corrupted wire: bucket 0 has scale -1.0, which no encoder writes ...
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable
from typing import Any

import torch

from commopt import kernels
from commopt.codecs._wire import check_values, check_wire, typed_view
from commopt.codecs.base import Codec, RngKey

#: the largest legal ``levels * scale``: float32's largest value, with a slack of 2^-20.
_TOP = float(torch.finfo(torch.float32).max) * (1 + 2.0**-20)


#: the largest bucket the kernels take (their bucket index is a 32-bit int).
_MAX_BUCKET = 2**31 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class QSGD(Codec):
    """Stochastic quantisation with ``bits`` bits per element (2, 4 or 8)."""

    linear = False
    wire_dtype = None

    def __init__(
        self,
        bits: int = 4,
        bucket_size: int = 128,
        scale: str = "max",
        stochastic: bool = True,
        *,
        levels: int | None = None,
        scale_dtype: torch.dtype = torch.float32,
    ):
        if not _is_int(bits) or bits not in kernels.QSGD_BITS:
            raise ValueError(f"QSGD bits must be one of {kernels.QSGD_BITS}, got {bits!r}")
        bits = int(bits)
        max_levels = 2 ** (bits - 1) - 1
        if levels is not None and not _is_int(levels):
            raise TypeError(f"QSGD levels must be an int or None, got {levels!r}")
        levels = max_levels if levels is None else int(levels)
        if not 1 <= levels <= max_levels:
            raise ValueError(
                f"QSGD levels must be in [1, {max_levels}] for {bits} bits, got {levels}"
            )
        if not _is_int(bucket_size) or not 1 <= bucket_size <= _MAX_BUCKET:
            raise ValueError(
                f"QSGD bucket_size must be an int in [1, {_MAX_BUCKET}], got {bucket_size!r}"
            )
        if scale not in kernels.NORMS:
            raise ValueError(f"QSGD scale must be one of {kernels.NORMS}, got {scale!r}")
        if scale_dtype not in (torch.float32, torch.float16):
            raise ValueError(
                f"QSGD scale_dtype must be torch.float32 or torch.float16, got {scale_dtype}"
            )
        self.bits = bits
        self.levels = levels
        self.bucket_size = int(bucket_size)
        self.norm = scale
        self.stochastic = bool(stochastic)
        self.scale_dtype = scale_dtype
        # An l2 norm can exceed the float32 range and float16 scales stop at 65504; and a
        # damaged wire's scale can be NaN/Inf whatever the settings (see the module's doc).
        self.can_overflow = True
        self.alignment = self.bucket_size
        self._scale_bytes = 4 if scale_dtype == torch.float32 else 2
        self.name = f"qsgd{bits}"

    def _params(self) -> dict[str, Any]:
        return dict(
            bits=self.bits,
            levels=self.levels,
            bucket_size=self.bucket_size,
            scale_bytes=self._scale_bytes,
        )

    def encoded_nbytes(self, numel: int) -> int:
        return kernels.qsgd_nbytes(
            int(numel), bits=self.bits, bucket_size=self.bucket_size, scale_bytes=self._scale_bytes
        )

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
        if rng is None:
            # Without a key the draw is not reproducible; the reducer always passes one.
            lo, hi = (int(w) for w in torch.randint(0, 2**32, (2,), dtype=torch.int64))
            words = (lo, hi)
        else:
            words = kernels.rng_words(rng.seed, rng.rank, rng.reduction, rng.stream)
        kernels.qsgd_encode(
            flat,
            out,
            key=words,
            norm=self.norm,
            stochastic=self.stochastic,
            scale=scale,
            **self._params(),
        )

    def decode_scaled(
        self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0
    ) -> None:
        """``decode`` writing ``alpha * decoded`` (error feedback uses ``alpha=-1``)."""
        self._decode(wire, out, accumulate, alpha, check_scales=True)

    decode = decode_scaled  # (alpha defaults to 1: the plain decode is the same kernel call)

    def decode_own(
        self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0
    ) -> None:
        """``decode_scaled`` without the check of the scales: the wire is this process's own
        encode (error feedback's read-back), whose scales need no check."""
        self._decode(wire, out, accumulate, alpha, check_scales=False)

    def _decode(
        self,
        wire: torch.Tensor,
        out: torch.Tensor,
        accumulate: bool,
        alpha: float,
        check_scales: bool,
    ) -> None:
        flat = check_values(self, out, "out")
        check_wire(self, wire, flat.numel(), "wire")
        if check_scales and wire.device.type == "cpu":  # on a GPU it would wait for the device
            self._check_scales(wire, flat.numel())
        kernels.qsgd_decode(wire, flat, accumulate=accumulate, alpha=alpha, **self._params())

    def _check_scales(self, wire: torch.Tensor, numel: int) -> None:
        """Raise for a scale no encoder writes (one read of the ``numel / bucket_size`` scales).

        An encoder's scale is ``norm / levels`` rounded up: never negative, and ``levels``
        times it stays within float32 (NaN and +Inf come from a non-finite bucket). A slack of
        2^-20 keeps the rounding up of a norm at the very top of the range legal.
        """
        nbuckets = -(-numel // self.bucket_size)
        if nbuckets == 0:
            return
        head = wire[: nbuckets * self._scale_bytes]
        scales = typed_view(head, self.scale_dtype)
        if scales is None:
            scales = head.clone().view(self.scale_dtype)
        # One pass and one host read on the good path: NaN and +Inf (legal) count as 0,
        # -Inf stays below 0; the top legal value is checked in float64 as below.
        low, high = torch.aminmax(torch.nan_to_num(scales, nan=0.0, posinf=0.0))
        if float(low) >= 0 and float(high) * self.levels <= _TOP:
            return
        steps = scales.to(torch.float64)
        bad = (steps < 0) | (torch.isfinite(steps) & (steps * self.levels > _TOP))
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            raise ValueError(
                f"{self.name}: corrupted wire: bucket {b} has scale {float(steps[b])!r}, which no "
                f"encoder writes (negative, or {self.levels} levels of it overflow float32). The "
                "sender's codec settings (bits, bucket_size, scale_dtype, levels) differ from "
                "this rank's, or the bytes were damaged on the way."
            )

    def __repr__(self) -> str:
        extra = "" if self.stochastic else ", stochastic=False"
        if self.levels != 2 ** (self.bits - 1) - 1:
            extra += f", levels={self.levels}"
        if self.scale_dtype != torch.float32:
            extra += ", scale_dtype=torch.float16"
        return f"QSGD(bits={self.bits}, bucket_size={self.bucket_size}, scale={self.norm!r}{extra})"
