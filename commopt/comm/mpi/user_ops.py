"""fp16 and bf16 sums for MPI, which has no 16-bit float type.

The buffers travel as raw 16-bit words; the user-defined reduction adds in fp32 and rounds
to nearest even once per pairwise addition (what torch's own 16-bit addition does), so the
wire still carries 16 bits.

    >>> import numpy as np
    >>> from commopt.comm.mpi.user_ops import bf16_to_f32, f32_to_bf16
    >>> bf16_to_f32(f32_to_bf16(np.array([1.5, -2.0], dtype=np.float32))).tolist()
    [1.5, -2.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from commopt.comm.mpi.runtime import _mpi

__all__ = ["bf16_to_f32", "f32_to_bf16", "sum16_op"]

_USER_OPS: dict[torch.dtype, Any] = {}


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does; NaN stays NaN."""
    bits = f32.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def _sum_fp16(inbuf, inoutbuf, datatype) -> None:
    a = np.frombuffer(inbuf, dtype=np.float16)
    b = np.frombuffer(inoutbuf, dtype=np.float16)
    # Add in fp32 and round once: the same as torch's fp16 addition.
    b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)


def _sum_bf16(inbuf, inoutbuf, datatype) -> None:
    a = np.frombuffer(inbuf, dtype=np.uint16)
    b = np.frombuffer(inoutbuf, dtype=np.uint16)
    b[...] = f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b))


def sum16_op(dtype: torch.dtype):
    MPI = _mpi()
    if dtype not in _USER_OPS:
        fn = _sum_fp16 if dtype == torch.float16 else _sum_bf16
        _USER_OPS[dtype] = MPI.Op.Create(fn, commute=True)
    return _USER_OPS[dtype]
