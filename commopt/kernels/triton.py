"""Triton kernels of the codecs: the one GPU implementation (NVIDIA and AMD from one source).

Called through :mod:`commopt.kernels` (which validates arguments); these functions trust
their inputs. Every float operation is one the reference performs, in the same order and
rounding: precise division (``tl.div_rn``), no multiply-add contraction (launched with
``enable_fp_fusion=False``), l2 norms summed in float64 along the reference's pairwise
tree. So the wires are bit-identical to :mod:`commopt.kernels.reference` for the same key.

On a machine without a GPU the same source runs under Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is first imported) on CPU tensors; that is how CI
executes it. :func:`commopt.kernels.triton_interpreted` says which mode this process got.

QSGD encode with max norms reads ``x`` once when its buckets start on a byte
(``bucket * bits % 8 == 0``) and fit a tile (``<= MAX_WIDTH``): each program holds whole buckets, takes their norms,
writes their scales and packs their codes. Otherwise it is two launches: one program per
group of buckets writes each bucket's scale (and its float32 step to a scratch array), then
one lane per wire byte quantises and packs the ``8 // bits`` elements of that byte. l2 norms
of buckets wider than ``MAX_WIDTH`` come from the reference's torch code (same tree, same
device); max norms of any width are computed in the kernel.

    >>> import torch
    >>> from commopt import kernels
    >>> device = "cpu" if kernels.triton_interpreted() else "cuda"
    >>> x = torch.linspace(-1, 1, 1000)
    >>> wire = torch.empty(kernels.qsgd_nbytes(1000, bits=4, bucket_size=100), dtype=torch.uint8)
    >>> kernels.qsgd_encode(
    ...     x, wire, bits=4, levels=7, bucket_size=100, key=(1, 2), impl="reference"
    ... )
    >>> on_device = torch.empty(wire.numel(), dtype=torch.uint8, device=device)
    >>> kernels.qsgd_encode(
    ...     x.to(device), on_device, bits=4, levels=7, bucket_size=100, key=(1, 2), impl="triton"
    ... )
    >>> torch.equal(on_device.cpu(), wire)
    True
"""

from __future__ import annotations

import os
import sys

import torch

# Triton reads TRITON_INTERPRET when it decorates its own and these kernels, so it is set
# before triton's first import, and only where torch sees no GPU (compiled kernels could
# not run there).
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

#: widest bucket whose l2 norm the kernel sums itself (a power of two).
MAX_WIDTH = 4096
#: the kernels run under the interpreter (CPU tensors) rather than compiled for a GPU.
INTERPRETED = False  # set below, from the type triton.jit gave the kernels


@triton.jit
def _lowbias32(x):
    # the reference's 32-bit finaliser, on uint32 (multiplications wrap mod 2^32)
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _start(PER_PROGRAM: tl.constexpr, WIDE: tl.constexpr):
    # int32 indices unless the buffer needs 64 bits: dividing by the bucket size is a
    # runtime division per element, several times dearer in 64 bits on a GPU
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    return pid * PER_PROGRAM


@triton.jit
def _tile_norm(y, ROWS: tl.constexpr, WIDTH: tl.constexpr, LOG2W: tl.constexpr):
    """l2 norm of each row of a (ROWS, WIDTH) tile (zeros beyond the bucket), as the reference."""
    y64 = y.to(tl.float64)
    sq = y64 * y64
    # the reference's tree: element j pairs with j + width/2, then the halves again
    for k in tl.static_range(LOG2W):
        sq = tl.sum(tl.reshape(sq, (ROWS, 2, WIDTH >> (k + 1))), axis=1)
    return tl.sqrt(tl.sum(sq, axis=1)).to(tl.float32)


@triton.jit
def _bitmax(y):
    # max of |y| per row through the bit patterns: exact, and NaN sorts above Inf
    return tl.max(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def _store_steps(m, rows, row_ok, out_ptr, levels, HALF: tl.constexpr):
    """Level spacing of each bucket from its norm ``m``; writes the scales, returns the steps."""
    # norm / levels rounded up so that levels * step >= norm
    step = tl.div_rn(m, levels.to(tl.float32))
    bump = step.to(tl.float64) * levels < m.to(tl.float64)
    step = tl.where(bump, (step.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), step)
    if HALF:
        half = step.to(tl.float16)
        hbits = half.to(tl.int16, bitcast=True)
        hbits = tl.where(half.to(tl.float32) < step, hbits + 1, hbits)
        step = hbits.to(tl.float16, bitcast=True).to(tl.float32)
        word = hbits.to(tl.int32) & 0xFFFF
        shifts = tl.arange(0, 2) * 8
        nbytes: tl.constexpr = 2
    else:
        word = step.to(tl.int32, bitcast=True)
        shifts = tl.arange(0, 4) * 8
        # Triton needs the constexpr annotation on each static branch's assignment
        nbytes: tl.constexpr = 4  # type: ignore[no-redef]
    # byte by byte: the wire may start at any offset
    byte = ((word[:, None] >> shifts[None, :]) & 0xFF).to(tl.uint8)
    dst = rows[:, None] * nbytes + tl.arange(0, nbytes)[None, :]
    tl.store(out_ptr + dst, byte, mask=row_ok[:, None])
    return step


@triton.jit
def _quantize(y, step, i, ok, levels, k0, k1, STOCHASTIC: tl.constexpr, BITS: tl.constexpr):
    """The sign+level code of each ``y`` (element index ``i``; 0 where not ``ok``)."""
    valid = (step > 0.0) & (step < float("inf"))
    t = tl.div_rn(tl.abs(y), tl.where(valid, step, 1.0))
    t = tl.where(valid, t, 0.0)
    low = tl.floor(t)
    frac = t - low
    if STOCHASTIC:
        h = _lowbias32(i.to(tl.uint32) + k0.to(tl.uint32, bitcast=True))
        h = _lowbias32(h ^ k1.to(tl.uint32, bitcast=True))
        up = ((h >> 8).to(tl.float32) * (2.0**-24)) < frac
    else:
        up = frac >= 0.5
    q = tl.minimum(low.to(tl.int32) + up.to(tl.int32), levels)
    neg = (y < 0.0) & (q > 0)
    return tl.where(ok, q | (neg.to(tl.int32) << (BITS - 1)), 0)


@triton.jit(do_not_specialize=["levels", "k0", "k1"])
def _qsgd_encode_fused_kernel(
    x_ptr,
    out_ptr,
    payload_ptr,
    n,
    nb,
    bucket,
    levels,
    k0,
    k1,
    scale,
    HAS_SCALE: tl.constexpr,
    HALF: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BITS: tl.constexpr,
    PER_BYTE: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDE: tl.constexpr,
):
    # One pass, max norms: ROWS whole buckets per program, held in one tile; buckets start on
    # a byte (bucket * BITS % 8 == 0), so each row packs its own bytes.
    rows = _start(ROWS, WIDE) + tl.arange(0, ROWS)
    row_ok = rows < nb
    cols = tl.arange(0, WIDTH)
    idx = rows[:, None] * bucket + cols[None, :]
    ok = row_ok[:, None] & (cols[None, :] < bucket) & (idx < n)
    y = tl.load(x_ptr + idx, mask=ok, other=0.0)
    if HAS_SCALE:
        y = y * scale
    m = _bitmax(y).to(tl.float32, bitcast=True)
    step = _store_steps(m, rows, row_ok, out_ptr, levels, HALF)
    code = _quantize(y, step[:, None], idx, ok, levels, k0, k1, STOCHASTIC, BITS)
    shifts = tl.arange(0, PER_BYTE) * BITS
    packed = tl.sum(
        tl.reshape(code, (ROWS, WIDTH // PER_BYTE, PER_BYTE)) << shifts[None, None, :], axis=2
    )
    col_byte = tl.arange(0, WIDTH // PER_BYTE)
    first = rows[:, None] * (bucket // PER_BYTE) + col_byte[None, :]
    keep = row_ok[:, None] & (col_byte[None, :] * PER_BYTE < bucket) & (first * PER_BYTE < n)
    tl.store(payload_ptr + first, packed.to(tl.uint8), mask=keep)


@triton.jit(do_not_specialize=["levels"])
def _qsgd_steps_kernel(
    x_ptr,
    norms_ptr,
    out_ptr,
    steps_ptr,
    n,
    nb,
    bucket,
    nchunks,
    levels,
    scale,
    HAS_SCALE: tl.constexpr,
    L2: tl.constexpr,
    PRE_NORMS: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    LOG2W: tl.constexpr,
    WIDE: tl.constexpr,
):
    # Two-pass encode, pass 1: the scales, and the steps for pass 2.
    rows = _start(ROWS, WIDE) + tl.arange(0, ROWS)
    row_ok = rows < nb
    cols = tl.arange(0, WIDTH)
    if PRE_NORMS:
        m = tl.load(norms_ptr + rows, mask=row_ok, other=0.0)
    elif L2:  # the whole bucket in one tile (wider ones come with PRE_NORMS)
        idx = rows[:, None] * bucket + cols[None, :]
        y = tl.load(
            x_ptr + idx, mask=row_ok[:, None] & (cols[None, :] < bucket) & (idx < n), other=0.0
        )
        if HAS_SCALE:
            y = y * scale
        m = _tile_norm(y, ROWS, WIDTH, LOG2W)
    else:  # any width, in chunks of WIDTH
        bitmax = tl.zeros((ROWS,), dtype=tl.int32)
        # a while loop: Triton 3.6's interpreter turns range(nchunks) into int() of a
        # one-element array, which NumPy 2.5 refuses
        c = 0
        while c < nchunks:
            j = c * WIDTH + cols
            idx = rows[:, None] * bucket + j[None, :]
            y = tl.load(
                x_ptr + idx, mask=row_ok[:, None] & (j[None, :] < bucket) & (idx < n), other=0.0
            )
            if HAS_SCALE:
                y = y * scale
            bitmax = tl.maximum(bitmax, _bitmax(y))
            c += 1
        m = bitmax.to(tl.float32, bitcast=True)
    step = _store_steps(m, rows, row_ok, out_ptr, levels, HALF)
    tl.store(steps_ptr + rows, step, mask=row_ok)


@triton.jit(do_not_specialize=["levels", "k0", "k1"])
def _qsgd_quantize_kernel(
    x_ptr,
    steps_ptr,
    payload_ptr,
    n,
    payload_bytes,
    bucket,
    levels,
    k0,
    k1,
    scale,
    HAS_SCALE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BITS: tl.constexpr,
    PER_BYTE: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
):
    # Two-pass encode, pass 2: one lane per wire byte (buckets may start inside a byte).
    byte = _start(BLOCK, WIDE) + tl.arange(0, BLOCK)
    e = tl.arange(0, PER_BYTE)
    i = byte[:, None] * PER_BYTE + e[None, :]
    ok = i < n
    y = tl.load(x_ptr + i, mask=ok, other=0.0)
    if HAS_SCALE:
        y = y * scale
    step = tl.load(steps_ptr + i // bucket, mask=ok, other=1.0)
    code = _quantize(y, step, i, ok, levels, k0, k1, STOCHASTIC, BITS)
    packed = tl.sum(code << (e * BITS)[None, :], axis=1)  # disjoint bits: the sum is an or
    tl.store(payload_ptr + byte, packed.to(tl.uint8), mask=byte < payload_bytes)


@triton.jit
def _store(out_ptr, offs, ok, v, alpha, HAS_ALPHA: tl.constexpr, ACCUMULATE: tl.constexpr):
    if HAS_ALPHA:
        v = v * alpha
    if ACCUMULATE:
        v = tl.load(out_ptr + offs, mask=ok, other=0.0) + v
    tl.store(out_ptr + offs, v, mask=ok)


@triton.jit
def _qsgd_decode_kernel(
    wire_ptr,
    out_ptr,
    n,
    nb,
    bucket,
    alpha,
    HAS_ALPHA: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    HALF: tl.constexpr,
    BITS: tl.constexpr,
    PER_BYTE: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
):
    i = _start(BLOCK, WIDE) + tl.arange(0, BLOCK)
    ok = i < n
    b = i // bucket
    if HALF:
        head = nb * 2
        lo = tl.load(wire_ptr + 2 * b, mask=ok, other=0).to(tl.int32)
        hi = tl.load(wire_ptr + 2 * b + 1, mask=ok, other=0).to(tl.int32)
        step = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        head = nb * 4
        word = tl.zeros((BLOCK,), dtype=tl.int32)
        for k in tl.static_range(4):
            word |= tl.load(wire_ptr + 4 * b + k, mask=ok, other=0).to(tl.int32) << (8 * k)
        step = word.to(tl.float32, bitcast=True)
    raw = tl.load(wire_ptr + head + i // PER_BYTE, mask=ok, other=0).to(tl.int32)
    code = (raw >> ((i % PER_BYTE).to(tl.int32) * BITS)) & ((1 << BITS) - 1)
    v = (code & ((1 << (BITS - 1)) - 1)).to(tl.float32) * step
    v = tl.where((code >> (BITS - 1)) != 0, -v, v)
    _store(out_ptr, i, ok, v, alpha, HAS_ALPHA, ACCUMULATE)


@triton.jit
def _to_bfloat16(y):
    # Round to nearest even on the bits: the same on every GPU and in the interpreter (whose
    # own float32 -> bfloat16 conversion rounds ties away from even).
    w = y.to(tl.uint32, bitcast=True)
    r = (w + 0x7FFF + ((w >> 16) & 1)) >> 16
    r = tl.where((w & 0x7FFFFFFF) > 0x7F800000, (w >> 16) | 0x40, r)  # NaN stays a quiet NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast_encode_kernel(x_ptr, out_ptr, n, scale, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    y = tl.load(x_ptr + i, mask=ok, other=0.0)
    if HAS_SCALE:
        y = y * scale
    if out_ptr.dtype.element_ty == tl.bfloat16:
        y = _to_bfloat16(y)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=ok)  # round to nearest even


@triton.jit
def _cast_decode_kernel(
    wire_ptr,
    out_ptr,
    n,
    alpha,
    HAS_ALPHA: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    w = tl.load(wire_ptr + i, mask=ok, other=0.0)
    if wire_ptr.dtype.element_ty == tl.bfloat16:
        # exact on the bits (the interpreter's own conversion mishandles subnormals)
        v = (w.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        v = w.to(tl.float32)
    _store(out_ptr, i, ok, v, alpha, HAS_ALPHA, ACCUMULATE)


INTERPRETED = type(_cast_encode_kernel).__name__ == "InterpretedFunction"
if (type(tl.max).__name__ == "InterpretedFunction") != INTERPRETED:
    raise ImportError(
        "TRITON_INTERPRET changed between the import of triton and of commopt's kernels; set it "
        "(or leave it unset) before triton is first imported"
    )
#: elements (or wire bytes) per program: the interpreter pays per program, a GPU per register.
BLOCK = 8192 if INTERPRETED else 1024
#: elements of the bucket-norm tile (several buckets per program when they are narrow).
TILE = 2048
#: elements per program of the one-pass encode on a GPU. On an H200 (256 MiB, 4-bit, 128-wide
#: buckets) 1024 ran 5% faster than 2048 with stochastic rounding and 13% with nearest; wider
#: tiles ran slower (benchmarks/gpu_bench.py measures the codecs).
FUSED_TILE = TILE if INTERPRETED else 1024
#: compile options of every launch: exact arithmetic (no multiply-add contraction), 4 warps.
LAUNCH = {} if INTERPRETED else {"enable_fp_fusion": False, "num_warps": 4}


def _i32(word: int) -> int:
    # a 32-bit key word as the signed int Triton passes as i32 (bitcast back in the kernel)
    return word - (1 << 32) if word >= 1 << 31 else word


def _wide(n: int, bucket_size: int) -> bool:
    # every index a program forms, masked lanes and a last partial tile included, stays
    # below 2^31 in int32 (with room: a wrapped index would pass the `< n` masks)
    nb = -(-n // bucket_size)
    return (nb + max(BLOCK, TILE) + 1) * max(bucket_size, MAX_WIDTH) + 8 * BLOCK >= 2**31


def _grid(work: int, per_program: int) -> tuple[int]:
    return (max(1, -(-work // per_program)),)


def _steps(x, out, *, bits, levels, bucket_size, norm, scale, scale_bytes):
    """Write the scales into ``out`` and return the float32 step of every bucket."""
    from commopt.kernels import reference as _ref

    n = x.numel()
    nb = -(-n // bucket_size)
    steps = torch.empty(nb, dtype=torch.float32, device=x.device)
    width = 1 << max(0, (bucket_size - 1).bit_length())
    l2 = norm == "l2"
    norms = None
    if l2 and width > MAX_WIDTH:
        y = x * scale if scale != 1.0 else x
        padded = torch.nn.functional.pad(y, (0, nb * bucket_size - n)).view(nb, bucket_size)
        norms = _ref.bucket_norm(padded, "l2").contiguous()
    width = min(width, MAX_WIDTH)
    rows = max(1, TILE // width)
    _qsgd_steps_kernel[_grid(nb, rows)](
        x,
        norms if norms is not None else steps,
        out,
        steps,
        n,
        nb,
        bucket_size,
        -(-bucket_size // width),
        levels,
        scale,
        HAS_SCALE=scale != 1.0,
        L2=l2,
        PRE_NORMS=norms is not None,
        HALF=scale_bytes == 2,
        ROWS=rows,
        WIDTH=width,
        LOG2W=width.bit_length() - 1,
        WIDE=_wide(n, bucket_size),
        **LAUNCH,
    )
    return steps


def qsgd_encode(
    x, out, *, bits, levels, bucket_size, key, norm, stochastic, scale, scale_bytes
) -> None:
    n = x.numel()
    nb = -(-n // bucket_size)
    head = nb * scale_bytes
    payload = out[head:]
    if n == 0:
        payload.zero_()
        return
    per_byte = 8 // bits
    width = 1 << max(0, (bucket_size - 1).bit_length())
    if norm == "max" and bucket_size % per_byte == 0 and width <= MAX_WIDTH:
        # buckets start on a byte and fit a tile: one pass over x. (Not for l2: Triton 3.7
        # takes minutes to compile the norm tree and the quantiser in one kernel.)
        code_bytes = (n * bits + 7) // 8
        payload[code_bytes:].zero_()
        rows = max(1, FUSED_TILE // width)
        _qsgd_encode_fused_kernel[_grid(nb, rows)](
            x,
            out,
            payload,
            n,
            nb,
            bucket_size,
            levels,
            _i32(key[0]),
            _i32(key[1]),
            scale,
            HAS_SCALE=scale != 1.0,
            HALF=scale_bytes == 2,
            STOCHASTIC=bool(stochastic),
            BITS=bits,
            PER_BYTE=per_byte,
            ROWS=rows,
            WIDTH=width,
            WIDE=_wide(n, bucket_size),
            **LAUNCH,
        )
        return
    steps = _steps(
        x,
        out,
        bits=bits,
        levels=levels,
        bucket_size=bucket_size,
        norm=norm,
        scale=scale,
        scale_bytes=scale_bytes,
    )
    _qsgd_quantize_kernel[_grid(payload.numel(), BLOCK // per_byte)](
        x,
        steps,
        payload,
        n,
        payload.numel(),
        bucket_size,
        levels,
        _i32(key[0]),
        _i32(key[1]),
        scale,
        HAS_SCALE=scale != 1.0,
        STOCHASTIC=bool(stochastic),
        BITS=bits,
        PER_BYTE=per_byte,
        BLOCK=BLOCK // per_byte,
        WIDE=_wide(n, bucket_size),
        **LAUNCH,
    )


def qsgd_decode(wire, out, *, bits, levels, bucket_size, accumulate, alpha, scale_bytes) -> None:
    n = out.numel()
    if n == 0:
        return
    _qsgd_decode_kernel[_grid(n, BLOCK)](
        wire,
        out,
        n,
        -(-n // bucket_size),
        bucket_size,
        alpha,
        HAS_ALPHA=alpha != 1.0,
        ACCUMULATE=bool(accumulate),
        HALF=scale_bytes == 2,
        BITS=bits,
        PER_BYTE=8 // bits,
        BLOCK=BLOCK,
        WIDE=_wide(n, bucket_size),
        **LAUNCH,
    )


def cast_encode(x, out, *, scale) -> None:
    n = x.numel()
    if n:
        _cast_encode_kernel[_grid(n, BLOCK)](
            x, out, n, scale, HAS_SCALE=scale != 1.0, BLOCK=BLOCK, **LAUNCH
        )


def cast_decode(wire, out, *, accumulate, alpha) -> None:
    n = out.numel()
    if n:
        _cast_decode_kernel[_grid(n, BLOCK)](
            wire,
            out,
            n,
            alpha,
            HAS_ALPHA=alpha != 1.0,
            ACCUMULATE=bool(accumulate),
            BLOCK=BLOCK,
            **LAUNCH,
        )
