"""Codec kernels as pure functions, and the choice of implementation per tensor.

Three implementations produce bit-identical wires for the same inputs and key:

* ``"native"``: C++ in ``commopt_ext/cpu_kernels.cpp`` (built by ``pip install``), for CPU
  tensors; multi-threaded with ``threads`` (default ``torch.get_num_threads()``).
* ``"triton"``: Triton kernels (``commopt.kernels.triton``), the GPU implementation (NVIDIA
  and AMD). On CPU tensors they run under Triton's interpreter, which is how CI executes them.
* ``"reference"``: plain torch (``commopt.kernels.reference``), any device; the spec.

``impl=None`` picks triton for CUDA tensors and native for CPU tensors (reference, with one
warning, when the library is not built). The environment variable ``COMMOPT_KERNELS``
(``native``, ``triton`` or ``reference``) overrides that choice for CPU tensors;
``COMMOPT_KERNELS=triton`` routes every codec through the Triton source under the interpreter
on a machine without a GPU (commopt sets ``TRITON_INTERPRET=1`` there before it loads the
kernels; on a GPU machine set it yourself): slow, meant for tests.

    >>> import torch
    >>> from commopt import kernels
    >>> key = kernels.rng_words(seed=0, rank=0, step=1, stream=0)
    >>> x = torch.linspace(-1, 1, 300)
    >>> wire = torch.empty(kernels.qsgd_nbytes(300, bits=4, bucket_size=128), dtype=torch.uint8)
    >>> kernels.qsgd_encode(x, wire, bits=4, levels=7, bucket_size=128, key=key)
    >>> ref = torch.empty_like(wire)
    >>> kernels.qsgd_encode(x, ref, bits=4, levels=7, bucket_size=128, key=key, impl="reference")
    >>> torch.equal(wire, ref)
    True
"""

from __future__ import annotations

import itertools
import os
import struct
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from commopt.kernels import reference as _ref

IMPLS = ("native", "triton", "reference")
#: the environment variable that picks the implementation for CPU tensors.
ENV_VAR = "COMMOPT_KERNELS"
#: the triton release torch 2.13's CUDA build depends on (the ``triton`` extra pins it).
TRITON_PIN = "triton==3.7.1"
NORMS = ("max", "l2")
QSGD_BITS = (2, 4, 8)
CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: one encode numbers its elements with 32-bit counters.
MAX_ENCODE_NUMEL = 2**32 - 1

qsgd_nbytes = _ref.qsgd_nbytes

_M64 = (1 << 64) - 1
_warned_no_native = False


def _mix64(z: int) -> int:
    # splitmix64 finaliser: a bijection of 64-bit words with full avalanche.
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def rng_words(seed: int, rank: int, step: int, stream: int = 0) -> tuple[int, int]:
    """The two 32-bit key words of the counter-based generator for one encode.

    Every element ``i`` of the encode then draws ``H(H(i + k0) ^ k1)`` (``H`` the 32-bit
    finaliser in ``kernels.reference``), so the numbers depend only on the key and the
    index: not on threads, kernels or devices.
    """
    state = 0x243F6A8885A308D3
    for value in (seed, rank, step, stream):
        state = _mix64((state + 0x9E3779B97F4A7C15 + (int(value) & _M64)) & _M64)
    return state & 0xFFFFFFFF, state >> 32


# ----------------------------------------------------------------------------- dispatch


def _native():
    from commopt.kernels import native as _native_kernels

    return _native_kernels


_native_loaded: bool | None = None


def _native_reason() -> str:
    try:
        return _native().load_error() or "not loaded"
    except OSError as err:
        return str(err)


def native_available() -> bool:
    """True when the C++ library ``commopt_ext._cpu`` is built and loads."""
    global _native_loaded
    if _native_loaded is None:
        try:
            _native_loaded = _native().load() is not None
        except OSError:
            _native_loaded = False
    return _native_loaded


def _pick(impl: str | None, *tensors: torch.Tensor) -> str:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if impl is None:
        if device.type == "cuda":
            return _check_triton(device)
        impl = _env_choice() if device.type == "cpu" else None
    if impl is None:
        if device.type == "cpu":
            if native_available():
                return "native"
            global _warned_no_native
            if not _warned_no_native:
                _warned_no_native = True
                warnings.warn(
                    f"commopt native CPU kernels unavailable ({_native_reason()}); using the slow "
                    "torch reference. Rebuild with `pip install -e .` (or `python setup.py "
                    "build_ext --inplace`).",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return "reference"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "native" and device.type != "cpu":
        raise ValueError(f"impl='native' needs CPU tensors, got {device}")
    if impl == "triton":
        return _check_triton(device)
    if impl == "native" and not native_available():
        raise RuntimeError(
            "impl='native' requested but commopt_ext._cpu is not built; run "
            "`python setup.py build_ext --inplace` (or `pip install -e .`)"
        )
    return impl


def _env_choice() -> str | None:
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if not choice:
        return None
    if choice not in IMPLS:
        raise ValueError(f"{ENV_VAR}={choice!r}: must be one of {IMPLS} (or unset)")
    return choice


def _triton():
    """The Triton kernels module; on a machine without a GPU, under the interpreter."""
    try:
        from commopt.kernels import triton as _triton_kernels
    except ImportError as err:
        raise ImportError(
            f"commopt's GPU codec kernels need Triton ({err}): pip install {TRITON_PIN} "
            "(CUDA builds of torch bring it), or pass impl='reference' to use plain torch"
        ) from err
    return _triton_kernels


def triton_interpreted() -> bool:
    """True when the Triton kernels run under the interpreter (CPU tensors) in this process."""
    return _triton().INTERPRETED


def _check_triton(device: torch.device) -> str:
    interpreted = _triton().INTERPRETED
    if device.type == "cpu" and not interpreted:
        raise ValueError(
            "impl='triton' on CPU tensors runs under Triton's interpreter, but triton was "
            "imported compiled for the GPU: set TRITON_INTERPRET=1 before triton is first "
            "imported, or move the tensors to the GPU"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"impl='triton' needs CUDA (or, interpreted, CPU) tensors, got {device}")
    if device.type == "cuda" and interpreted:
        raise ValueError(
            "the Triton kernels were loaded under the interpreter (TRITON_INTERPRET=1); unset "
            "it to run them compiled on CUDA tensors"
        )
    return "triton"


def _backend(impl: str):
    if impl == "native":
        return _native()
    if impl == "triton":
        return _triton()
    return _ref


def _check_flat(name: str, t: torch.Tensor, dtype: torch.dtype | tuple, numel: int | None = None):
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel}")


def _check_qsgd(bits: int, levels: int, bucket_size: int, norm: str, scale_bytes: int) -> None:
    if bits not in QSGD_BITS:
        raise ValueError(f"bits must be one of {QSGD_BITS}, got {bits}")
    if not 1 <= levels <= 2 ** (bits - 1) - 1:
        raise ValueError(
            f"levels must be in [1, {2 ** (bits - 1) - 1}] for {bits} bits, got {levels}"
        )
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if scale_bytes not in (2, 4):
        raise ValueError(
            f"scale_bytes must be 4 (float32 scales) or 2 (float16), got {scale_bytes}"
        )


def _scale32(scale: float) -> float:
    # Every implementation multiplies by the same float32 value.
    return struct.unpack("f", struct.pack("f", float(scale)))[0]


def _run(op: str, which: str, threads: int | None, *tensors: torch.Tensor, **kwargs: Any) -> None:
    # Only the native kernels take a thread count.
    if which == "native":
        kwargs["threads"] = threads
    getattr(_backend(which), op)(*tensors, **kwargs)


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
    impl: str | None = None,
    threads: int | None = None,
) -> None:
    """Quantise ``x * scale`` (float32, contiguous) into the uint8 wire ``out``.

    Wire: ``ceil(n / bucket_size)`` scales (level spacing, float32 or float16), then one
    ``bits``-bit sign+magnitude code per element packed little-endian, zero padding to a
    multiple of 4 bytes. ``key`` comes from :func:`rng_words`.
    """
    _check_qsgd(bits, levels, bucket_size, norm, scale_bytes)
    _check_flat("x", x, torch.float32)
    if x.numel() > MAX_ENCODE_NUMEL:
        raise ValueError(f"one encode takes at most {MAX_ENCODE_NUMEL} elements; split the buffer")
    nbytes = qsgd_nbytes(x.numel(), bits=bits, bucket_size=bucket_size, scale_bytes=scale_bytes)
    _check_flat("out", out, torch.uint8, nbytes)
    k0, k1 = (int(k) & 0xFFFFFFFF for k in key)
    _run(
        "qsgd_encode",
        _pick(impl, x, out),
        threads,
        x,
        out,
        bits=bits,
        levels=levels,
        bucket_size=bucket_size,
        key=(k0, k1),
        norm=norm,
        stochastic=stochastic,
        scale=_scale32(scale),
        scale_bytes=scale_bytes,
    )


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
    impl: str | None = None,
    threads: int | None = None,
) -> None:
    """Write (or, with ``accumulate``, add) ``alpha * decode(wire)`` into float32 ``out``."""
    _check_qsgd(bits, levels, bucket_size, "max", scale_bytes)
    _check_flat("out", out, torch.float32)
    nbytes = qsgd_nbytes(out.numel(), bits=bits, bucket_size=bucket_size, scale_bytes=scale_bytes)
    _check_flat("wire", wire, torch.uint8, nbytes)
    _run(
        "qsgd_decode",
        _pick(impl, wire, out),
        threads,
        wire,
        out,
        bits=bits,
        levels=levels,
        bucket_size=bucket_size,
        accumulate=accumulate,
        alpha=_scale32(alpha),
        scale_bytes=scale_bytes,
    )


def cast_encode(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float = 1.0,
    impl: str | None = None,
    threads: int | None = None,
) -> None:
    """Write ``x * scale`` into ``out`` (float32, float16 or bfloat16; round to nearest even)."""
    _check_flat("x", x, torch.float32)
    _check_flat("out", out, CAST_DTYPES, x.numel())
    _run("cast_encode", _pick(impl, x, out), threads, x, out, scale=_scale32(scale))


def cast_decode(
    wire: torch.Tensor,
    out: torch.Tensor,
    *,
    accumulate: bool = False,
    alpha: float = 1.0,
    impl: str | None = None,
    threads: int | None = None,
) -> None:
    """Write (or add) ``alpha * float32(wire)`` into float32 ``out``."""
    _check_flat("wire", wire, CAST_DTYPES)
    _check_flat("out", out, torch.float32, wire.numel())
    _run(
        "cast_decode",
        _pick(impl, wire, out),
        threads,
        wire,
        out,
        accumulate=accumulate,
        alpha=_scale32(alpha),
    )


# ----------------------------------------------------------------------------- pack and check
# One pass over the gradient where there were two: the copy into the bucket and the NaN/Inf
# check (``pack_nonfinite``), and the check alone after the reduction (``nonfinite``).
# Exact: a value is flagged iff it is NaN or +-Inf (``flat.sum()`` can also overflow).


def _check_pieces(pieces, dst: torch.Tensor) -> list[tuple]:
    out, end = [], dst.numel()
    for k, piece in enumerate(pieces):
        src, offset, numel = piece
        offset, numel = int(offset), int(numel)
        if offset < 0 or numel < 0 or offset + numel > end:
            raise ValueError(
                f"piece {k} writes [{offset}, {offset + numel}) outside dst's {end} elements"
            )
        if src is not None:
            _check_flat(f"piece {k}'s source", src, torch.float32, numel)
            if src.device != dst.device:
                raise ValueError(f"piece {k}'s source is on {src.device}, dst on {dst.device}")
        out.append((src, offset, numel))
    ranges = sorted((o, o + n) for _, o, n in out if n)
    if any(b[0] < a[1] for a, b in itertools.pairwise(ranges)):
        raise ValueError("pieces overlap in dst: give each its own range")
    return out


def pack_nonfinite(
    pieces, dst: torch.Tensor, *, impl: str | None = None, threads: int | None = None
) -> bool:
    """Copy ``pieces`` into float32 ``dst``; True if a copied value is NaN or +-Inf.

    Each piece is ``(src, offset, numel)``: ``src`` (float32, contiguous, ``numel``
    elements, or None for zeros) goes to ``dst[offset:offset + numel]``. One pass over the
    data; what ``dst`` holds outside the pieces is neither written nor checked.

        >>> import torch
        >>> dst = torch.full((5,), 7.0)
        >>> pack_nonfinite([(torch.tensor([1.0, 2.0]), 0, 2), (None, 2, 2)], dst)
        False
        >>> dst.tolist()
        [1.0, 2.0, 0.0, 0.0, 7.0]
        >>> pack_nonfinite([(torch.tensor([float("inf")]), 4, 1)], dst)
        True
    """
    _check_flat("dst", dst, torch.float32)
    checked = _check_pieces(pieces, dst)
    which = _pick(impl, dst)
    if which == "native":
        return _native().pack_nonfinite(checked, dst, threads=threads)
    bad = False
    for src, offset, numel in checked:
        part = dst[offset : offset + numel]
        if src is None:
            part.zero_()
        else:
            part.copy_(src.reshape(-1))
            bad = bad or not bool(torch.isfinite(part).all())
    return bad


def nonfinite(x: torch.Tensor, *, impl: str | None = None, threads: int | None = None) -> bool:
    """True if float32 ``x`` (contiguous) holds a NaN or +-Inf: one read of every element.

    >>> import torch
    >>> nonfinite(torch.tensor([1.0, -3e38])), nonfinite(torch.tensor([0.0, float("nan")]))
    (False, True)
    """
    _check_flat("x", x, torch.float32)
    which = _pick(impl, x)
    if which == "native":
        return _native().nonfinite(x, threads=threads)
    return not bool(torch.isfinite(x).all())


def any_nonfinite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` (any dtype, device or layout) holds a NaN or +-Inf.

    Exact: huge finite values are no false alarm. Contiguous float32 tensors on the CPU are
    read once each by :func:`nonfinite` (about a tenth of ``torch.isfinite(t).all()``'s time);
    the others are checked together with one synchronisation.

    >>> import torch
    >>> any_nonfinite([torch.ones(3), torch.tensor([1.0, float("inf")])])
    True
    >>> any_nonfinite([torch.tensor([3e38, 3e38]), torch.zeros(2, dtype=torch.float16)])
    False
    """
    rest = []
    for t in tensors:
        if (
            t.layout == torch.strided
            and t.device.type == "cpu"
            and t.dtype == torch.float32
            and t.is_contiguous()
        ):
            if nonfinite(t.view(-1)):
                return True
        else:
            rest.append(t)
    if not rest:
        return False
    if len(rest) == 1:
        return not bool(torch.isfinite(rest[0]).all())
    return not bool(torch.stack([torch.isfinite(t).all() for t in rest]).all())


# ----------------------------------------------------------------------------- end pack and check
