"""ctypes binding of the C++ kernels in ``commopt_ext/cpu_kernels.cpp`` (``commopt_ext._cpu``).

The library is loaded with ``ctypes.CDLL``, which releases the GIL for the length of every
call: a kernel running on the collectives' thread leaves the training thread free to run
Python (``ctypes.PyDLL`` would hold it).

Called through :mod:`commopt.kernels`, which validates arguments first; these functions
trust their inputs (contiguous CPU tensors of the right dtype and size).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from commopt.native_libraries import find_extension

#: must match commopt_abi_version() in cpu_kernels.cpp.
ABI_VERSION = 3

_lib = None
_load_error: str | None = None

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _find_library() -> Path | None:
    return find_extension("_cpu")


def load():
    """The loaded library, or None when it is missing or from another ABI version."""
    global _lib, _load_error
    if _lib is not None or _load_error is not None:
        return _lib
    path = _find_library()
    if path is None:
        _load_error = "commopt_ext._cpu not found"
        return None
    lib = ctypes.CDLL(str(path))
    version = lib.commopt_abi_version() if hasattr(lib, "commopt_abi_version") else 0
    if version != ABI_VERSION:
        _load_error = f"{path} has ABI {version}, expected {ABI_VERSION}: rebuild it"
        return None
    vp, i64, i32, u32, f32 = (
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_float,
    )
    lib.commopt_qsgd_encode.argtypes = [
        vp,
        vp,
        i64,
        i32,
        i32,
        i64,
        i32,
        i32,
        u32,
        u32,
        f32,
        i32,
        i32,
    ]
    lib.commopt_qsgd_encode.restype = i32
    lib.commopt_qsgd_decode.argtypes = [vp, vp, i64, i32, i32, i64, i32, i32, f32, i32]
    lib.commopt_qsgd_decode.restype = i32
    lib.commopt_cast_encode.argtypes = [vp, vp, i64, i32, f32, i32]
    lib.commopt_cast_encode.restype = i32
    lib.commopt_cast_decode.argtypes = [vp, vp, i64, i32, i32, f32, i32]
    lib.commopt_cast_decode.restype = i32
    lib.commopt_nonfinite.argtypes = [vp, i64, i32]
    lib.commopt_nonfinite.restype = i32
    lib.commopt_pack_nonfinite.argtypes = [vp, vp, vp, i64, vp, i32]
    lib.commopt_pack_nonfinite.restype = i32
    _lib = lib
    return _lib


def load_error() -> str | None:
    load()
    return _load_error


def _threads(threads: int | None) -> int:
    return max(1, int(threads) if threads else torch.get_num_threads())


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native {what} failed with code {rc} (invalid arguments)")


def qsgd_encode(
    x, out, *, bits, levels, bucket_size, key, norm, stochastic, scale, scale_bytes, threads=None
) -> None:
    rc = load().commopt_qsgd_encode(
        x.data_ptr(),
        out.data_ptr(),
        x.numel(),
        bits,
        levels,
        bucket_size,
        1 if norm == "l2" else 0,
        1 if stochastic else 0,
        key[0],
        key[1],
        scale,
        scale_bytes,
        _threads(threads),
    )
    _check(rc, "qsgd_encode")


def qsgd_decode(
    wire, out, *, bits, levels, bucket_size, accumulate, alpha, scale_bytes, threads=None
) -> None:
    rc = load().commopt_qsgd_decode(
        wire.data_ptr(),
        out.data_ptr(),
        out.numel(),
        bits,
        levels,
        bucket_size,
        scale_bytes,
        1 if accumulate else 0,
        alpha,
        _threads(threads),
    )
    _check(rc, "qsgd_decode")


def cast_encode(x, out, *, scale, threads=None) -> None:
    rc = load().commopt_cast_encode(
        x.data_ptr(), out.data_ptr(), x.numel(), _DTYPE_CODE[out.dtype], scale, _threads(threads)
    )
    _check(rc, "cast_encode")


def cast_decode(wire, out, *, accumulate, alpha, threads=None) -> None:
    rc = load().commopt_cast_decode(
        wire.data_ptr(),
        out.data_ptr(),
        out.numel(),
        _DTYPE_CODE[wire.dtype],
        1 if accumulate else 0,
        alpha,
        _threads(threads),
    )
    _check(rc, "cast_decode")


def nonfinite(x, *, threads=None) -> bool:
    rc = load().commopt_nonfinite(x.data_ptr(), x.numel(), _threads(threads))
    if rc < 0:
        _check(rc, "nonfinite")
    return bool(rc)


def pack_nonfinite(pieces, dst, *, threads=None) -> bool:
    """``pieces``: (float32 source or None for zeros, offset into ``dst``, numel) each."""
    count = len(pieces)
    srcs = (ctypes.c_void_p * count)(
        *[None if src is None else src.data_ptr() for src, _, _ in pieces]
    )
    offsets = (ctypes.c_int64 * count)(*[int(off) for _, off, _ in pieces])
    numels = (ctypes.c_int64 * count)(*[int(n) for _, _, n in pieces])
    rc = load().commopt_pack_nonfinite(
        srcs, offsets, numels, count, dst.data_ptr(), _threads(threads)
    )
    if rc < 0:
        _check(rc, "pack_nonfinite")
    return bool(rc)
