"""mpi4py, imported lazily, and the bridge from torch tensors to MPI buffers.

Importing mpi4py starts MPI, so it happens on first use (:func:`_mpi`), which also installs
the hook that aborts the job when an exception escapes on one rank.

    >>> import torch
    >>> from commopt.comm.mpi.runtime import numpy_view
    >>> numpy_view(torch.tensor([1.0, 2.0], dtype=torch.float16)).dtype   # 16-bit words
    dtype('int16')
"""
from __future__ import annotations

import sys

import torch

__all__ = ["mpi_type", "numpy_view"]

_MPI = None


def _mpi():
    """Import mpi4py lazily; a missing package names what to install."""
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the 'mpi' communicator needs mpi4py and an MPI library: "
                "pip install 'commopt[mpi]' (and apt-get install openmpi-bin libopenmpi-dev)"
            ) from exc
        _MPI = MPI
        _install_abort_hook(MPI)
    return _MPI


def _install_abort_hook(MPI) -> None:
    """An uncaught exception on one rank aborts the job instead of hanging its peers."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


def mpi_type(dtype: torch.dtype):
    MPI = _mpi()
    return {
        torch.float32: MPI.FLOAT,
        torch.float64: MPI.DOUBLE,
        torch.int32: MPI.INT32_T,
        torch.int64: MPI.INT64_T,
        torch.float16: MPI.INT16_T,  # raw 16-bit words, summed by a user-defined op
        torch.bfloat16: MPI.INT16_T,
    }[dtype]


def numpy_view(t: torch.Tensor, as_bytes: bool = False):
    """An MPI buffer sharing memory with the contiguous tensor ``t``.

    A CPU tensor becomes a NumPy array. A device tensor (CUDA-aware MPI) stays a tensor,
    viewed with the same word type: mpi4py reads its ``__cuda_array_interface__``
    (``.numpy()`` would raise, and the interface has no bfloat16).
    """
    flat = t.reshape(-1)
    if as_bytes:
        flat = flat.view(torch.uint8)
    elif t.dtype in (torch.float16, torch.bfloat16):
        flat = flat.view(torch.int16)
    return flat.numpy() if flat.device.type == "cpu" else flat
