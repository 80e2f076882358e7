"""Plain-torch reference of every codec kernel: the executable specification.

The native (C++) and Triton kernels must produce bit-identical wires to these functions for
the same inputs and key; ``tests/unit/test_kernels_*.py`` check that with hypothesis.
They run on any device torch supports, so they are also the fallback when no native
kernel is available. See docs/codecs.md for the wire formats and the random numbers.

    >>> import torch
    >>> from commopt.kernels import reference as ref
    >>> x = torch.tensor([0.5, -1.0, 0.25])
    >>> wire = torch.empty(ref.qsgd_nbytes(3, bits=4, bucket_size=128), dtype=torch.uint8)
    >>> ref.qsgd_encode(x, wire, bits=4, levels=7, bucket_size=128, key=(1, 2))
    >>> out = torch.zeros(3)
    >>> ref.qsgd_decode(wire, out, bits=4, levels=7, bucket_size=128)
    >>> bool((out - x).abs().max() < 1.0 / 7)
    True
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
#: multipliers of the 32-bit finaliser ("lowbias32", C. Wellons' hash-prospector search).
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B


def qsgd_nbytes(numel: int, *, bits: int, bucket_size: int, scale_bytes: int = 4) -> int:
    """Exact wire size: per-bucket scales, packed codes, zero padding to a multiple of 4."""
    nbuckets = -(-numel // bucket_size)
    raw = nbuckets * scale_bytes + (numel * bits + 7) // 8
    return (raw + 3) // 4 * 4


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow (which torch leaves
    # undefined): split c in 16-bit halves so every product stays below 2^48.
    # Consumes x (in-place ops keep the reference from allocating per step).
    lo = x * (c & 0xFFFF)
    return x.mul_(c >> 16).bitwise_and_(0xFFFF).bitwise_left_shift_(16).add_(lo).bitwise_and_(_M32)


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    x.bitwise_xor_(x >> 16)
    x = _mul32_(x, _MUL_A)
    x.bitwise_xor_(x >> 15)
    x = _mul32_(x, _MUL_B)
    return x.bitwise_xor_(x >> 16)


def uniform_bits(index: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """The 32-bit random word of each element index (int64 tensor of values in [0, 2^32))."""
    k0, k1 = key
    x = _lowbias32_((index + k0).bitwise_and_(_M32))
    return _lowbias32_(x.bitwise_xor_(k1))


def _uniform24(n: int, key: tuple[int, int], device: torch.device | str | None) -> torch.Tensor:
    idx = torch.arange(n, dtype=torch.int64, device=device)
    u = uniform_bits(idx, key)
    # 24 random bits -> float32 in [0, 1), exactly representable.
    return u.bitwise_right_shift_(8).to(torch.float32).mul_(2.0**-24)


def bucket_norm(y: torch.Tensor, norm: str) -> torch.Tensor:
    """Per-row max-abs (NaN-propagating, via the bit patterns) or l2 norm (fixed order)."""
    if norm == "max":
        # For non-negative floats the int order is the float order, and NaN patterns sort
        # above +Inf: the max of the bits is exact and propagates NaN.
        bits = y.contiguous().view(torch.int32) & 0x7FFFFFFF
        return bits.amax(dim=1).view(torch.float32) if y.shape[1] else y.new_zeros(y.shape[0])
    # l2: squares are exact in float64; a pairwise tree over a power-of-two width fixes the
    # order of the additions so every implementation gets the same bits.
    sq = y.to(torch.float64).square()
    width = 1
    while width < sq.shape[1]:
        width *= 2
    if width != sq.shape[1]:
        sq = torch.nn.functional.pad(sq, (0, width - sq.shape[1]))
    while sq.shape[1] > 1:
        half = sq.shape[1] // 2
        sq = sq[:, :half] + sq[:, half:]
    return sq[:, 0].sqrt().to(torch.float32)


def _next_up(x: torch.Tensor) -> torch.Tensor:
    # For non-negative finite floats the next representable value is bits + 1.
    return (x.view(torch.int32) + 1).view(torch.float32)


def bucket_steps(m: torch.Tensor, levels: int, scale_bytes: int) -> torch.Tensor:
    """Level spacing per bucket: norm / levels rounded up so levels * step >= norm.

    Returned as float32 (the value the quantiser and decoder use); with 2-byte scales it
    is additionally rounded up to float16.
    """
    # A tensor divisor: torch's CUDA division by a Python number multiplies by its reciprocal,
    # which is not the correctly rounded quotient the other implementations compute.
    step = m / torch.full_like(m, levels)
    bump = step.to(torch.float64) * levels < m.to(torch.float64)
    step = torch.where(bump, _next_up(step), step)
    if scale_bytes == 2:
        half = step.to(torch.float16)
        bump = half.to(torch.float32) < step
        half = torch.where(bump, (half.view(torch.int16) + 1).view(torch.float16), half)
        step = half.to(torch.float32)
    return step


def _split_wire(
    wire: torch.Tensor, nbuckets: int, scale_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    scale_dtype = torch.float32 if scale_bytes == 4 else torch.float16
    # copy: the wire may sit at an offset that is not a multiple of the scale size
    scales = wire[: nbuckets * scale_bytes].clone().view(scale_dtype)
    return scales, wire[nbuckets * scale_bytes :]


def qsgd_encode(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    bits: int,
    levels: int,
    bucket_size: int,
    key: tuple[int, int],
    norm: str = "max",
    stochastic: bool = True,
    scale: float = 1.0,
    scale_bytes: int = 4,
) -> None:
    """Quantise ``x * scale`` into ``out`` (uint8, ``qsgd_nbytes`` bytes)."""
    n = x.numel()
    nb = -(-n // bucket_size)
    per_byte = 8 // bits
    y = x.reshape(-1)
    if scale != 1.0:
        y = y * scale
    padded = nb * bucket_size
    if padded != n:
        y = torch.nn.functional.pad(y, (0, padded - n))
    yb = y.view(nb, bucket_size)
    step = bucket_steps(bucket_norm(yb, norm), levels, scale_bytes)
    valid = (step > 0) & (step < float("inf"))
    safe_step = torch.where(valid, step, torch.ones_like(step))
    t = yb.abs() / safe_step[:, None]
    t = torch.where(valid[:, None], t, torch.zeros_like(t))
    low = torch.floor(t)
    frac = t - low
    if stochastic:
        up = _uniform24(padded, key, x.device).view(nb, bucket_size) < frac
    else:
        up = frac >= 0.5
    q = torch.clamp(low.to(torch.int64) + up.to(torch.int64), max=levels)
    sign = (yb < 0) & (q > 0)
    codes = (q | (sign.to(torch.int64) << (bits - 1))).reshape(-1)[:n]
    ncode_bytes = (n * bits + 7) // 8
    if ncode_bytes * per_byte != n:
        codes = torch.nn.functional.pad(codes, (0, ncode_bytes * per_byte - n))
    codes = codes.view(ncode_bytes, per_byte)
    shifts = torch.arange(per_byte, device=x.device, dtype=torch.int64) * bits
    packed = (codes << shifts).sum(dim=1).to(torch.uint8)
    scale_dtype = torch.float32 if scale_bytes == 4 else torch.float16
    head = nb * scale_bytes
    out[:head].copy_(step.to(scale_dtype).view(torch.uint8))
    out[head : head + ncode_bytes].copy_(packed)
    out[head + ncode_bytes :].zero_()


def qsgd_decode(
    wire: torch.Tensor,
    out: torch.Tensor,
    *,
    bits: int,
    levels: int,
    bucket_size: int,
    accumulate: bool = False,
    alpha: float = 1.0,
    scale_bytes: int = 4,
) -> None:
    """Write (or add, with ``accumulate``) ``alpha * decoded`` into float32 ``out``."""
    n = out.numel()
    if n == 0:
        return
    nb = -(-n // bucket_size)
    per_byte = 8 // bits
    scales, payload = _split_wire(wire, nb, scale_bytes)
    step = scales.to(torch.float32)
    ncode_bytes = (n * bits + 7) // 8
    b = payload[:ncode_bytes].to(torch.int64)
    shifts = torch.arange(per_byte, device=wire.device, dtype=torch.int64) * bits
    codes = ((b[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]
    q = codes & ((1 << (bits - 1)) - 1)
    neg = (codes >> (bits - 1)).bool()
    padded = nb * bucket_size
    qf = q.to(torch.float32)
    if padded != n:
        qf = torch.nn.functional.pad(qf, (0, padded - n))
        neg = torch.nn.functional.pad(neg, (0, padded - n))
    v = qf.view(nb, bucket_size) * step[:, None]
    v = torch.where(neg.view(nb, bucket_size), -v, v).reshape(-1)[:n]
    _store(out, v, accumulate, alpha)


def _store(out: torch.Tensor, v: torch.Tensor, accumulate: bool, alpha: float) -> None:
    flat = out.view(-1)
    if alpha != 1.0:
        v = v * alpha
    if accumulate:
        flat.add_(v)
    else:
        flat.copy_(v)


def cast_encode(x: torch.Tensor, out: torch.Tensor, *, scale: float = 1.0) -> None:
    """Write ``x * scale`` rounded to nearest even into ``out`` (float32/float16/bfloat16)."""
    y = x.reshape(-1)
    if scale != 1.0:
        y = y * scale
    out.view(-1).copy_(y)


def cast_decode(
    wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0
) -> None:
    """Write (or add) ``alpha * float32(wire)`` into float32 ``out``."""
    _store(out, wire.reshape(-1).to(torch.float32), accumulate, alpha)


# ----------------------------------------------------------------------------- comparing outputs
# How another implementation's output is held against the reference's. One allowance: the
# bits of a NaN. torch itself does not fix them (its CPU float16 -> float32 conversion gives
# 0x7FFFFFFF on its scalar path and 0x7FC00000 on its vector path, by tensor size), so a NaN
# must meet a NaN; every other bit must be equal.


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, on any devices (compared on the CPU unless both share one), except
    that any NaN matches any NaN.

    >>> nan = float("nan")
    >>> same_bits(torch.tensor([1.0, nan]), torch.tensor([1.0, -nan]))
    True
    >>> same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    False
    """
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    na, nb = a.float().isnan(), b.float().isnan()
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return (
        a.dtype == b.dtype
        and torch.equal(na, nb)
        and torch.equal(a[~na].view(view), b[~nb].view(view))
    )


def same_wire(
    a: torch.Tensor, b: torch.Tensor, numel: int, bucket_size: int, scale_bytes: int
) -> bool:
    """Two QSGD wires of ``numel`` elements agree: codes and padding byte for byte, the
    scales by :func:`same_bits`."""
    head = -(-numel // bucket_size) * scale_bytes
    dtype = torch.float32 if scale_bytes == 4 else torch.float16
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    return torch.equal(a[head:], b[head:]) and same_bits(a[:head].view(dtype), b[:head].view(dtype))
