"""mpi4py, imported lazily, and the bridge from torch tensors to MPI buffers.

Importing mpi4py starts MPI, so it happens on first use (:func:`_mpi`), which also installs
the hook that aborts the job when an exception escapes on one rank.

A rank that leaves without an exception (its script returns early, or calls ``sys.exit``)
would otherwise sit in MPI_Finalize while its peers wait for it in a collective, forever.
:func:`install_exit_handshake` (the first world communicator calls it) makes every rank,
when it leaves, enter a non-blocking barrier on a private duplicate of COMM_WORLD: when all
ranks finish normally they all reach it and leave at once; a rank that leaves while others
still run waits at most $COMMOPT_EXIT_TIMEOUT seconds (default 30) for them, then aborts the
job with a message naming itself, so no peer hangs.

    >>> import torch
    >>> from commopt.comm.mpi.runtime import numpy_view
    >>> numpy_view(torch.tensor([1.0, 2.0], dtype=torch.float16)).dtype  # 16-bit words
    dtype('int16')
"""

from __future__ import annotations

import os
import sys
import threading
import time

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


#: Seconds a leaving rank waits for the others to leave too before it aborts the job.
EXIT_TIMEOUT_ENV = "COMMOPT_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT_S = 30.0
_exit_comm = None  # the private COMM_WORLD duplicate of the exit barrier


def exit_timeout() -> float:
    """$COMMOPT_EXIT_TIMEOUT in seconds (default 30)."""
    raw = os.environ.get(EXIT_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_EXIT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{EXIT_TIMEOUT_ENV}={raw!r}: give seconds, e.g. 30") from None
    return max(value, 0.0)


def install_exit_handshake() -> None:
    """Every rank meets the others when it leaves, or aborts the job (a collective call, once).

    Runs at the start of interpreter shutdown (before threads are joined, so a worker thread
    stuck in a collective cannot keep it from running).
    """
    global _exit_comm
    MPI = _mpi()
    if _exit_comm is not None or MPI.COMM_WORLD.Get_size() == 1:
        return
    exit_timeout()  # a bad value fails now, on every rank, not at exit
    _exit_comm = MPI.COMM_WORLD.Dup()
    threading._register_atexit(_leave)  # type: ignore[attr-defined]  # what concurrent.futures uses to join its workers


def _leave() -> None:
    MPI = _MPI
    if _exit_comm is None or MPI is None or MPI.Is_finalized():
        return
    world = MPI.COMM_WORLD
    limit = exit_timeout()
    wait_or_abort(
        _exit_comm.Ibarrier(),
        limit,
        f"commopt: rank {world.Get_rank()} of {world.Get_size()} left the job (its "
        f"script returned or called sys.exit) while other ranks were still running; "
        f"they would wait for it in their next collective forever, so it aborts the "
        f"job after waiting {limit:g}s (${EXIT_TIMEOUT_ENV}). Ranks that run out of "
        f"data early: train inside `with commopt.Join(optimizer):`; a rank that works "
        f"longer at the end (saving): call comm.barrier() before the others leave.\n",
    )


def wait_or_abort(request, limit: float, message: str) -> None:
    """Wait for the exit barrier's ``request``; after ``limit`` s print ``message`` and abort.

    Polls with sleeps that grow from 0.1 ms to 10 ms: at a normal end the others arrive
    within milliseconds, and a rank left waiting costs no core.
    """
    deadline = time.monotonic() + limit
    pause = 0.0001
    while not request.Test():
        if time.monotonic() > deadline:
            sys.stdout.flush()
            sys.stderr.write(message)
            sys.stderr.flush()
            _mpi().COMM_WORLD.Abort(1)
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


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
