"""Deadlines that hold even when every Python thread is frozen.

A native call that blocks while it holds the GIL (Horovod's enqueue functions wait on a lock
that Horovod's background thread holds during a blocking MPI call) stops every Python thread
of the process, the communication watchdog included. :func:`deadline` arms a clock watched by
a native thread (``commopt_ext._deadline``, loaded with ctypes): if the block it guards is
still running ``seconds`` later, that thread writes ``message`` to stderr, waits two seconds
(peers whose clocks ran out too can say so) and ends the process with exit code 1 (a launcher
such as mpirun then ends the job). Without the
library, ``faulthandler.dump_traceback_later`` is the clock (native too): it cannot write
the message, so it prints the threads' stacks before it ends the process, and only one such
clock is armed at a time.

    >>> with deadline(60.0, "commopt: rank 0: a call made no progress for 60 s\\n"):
    ...     pass  # returns long before: nothing happens
    >>> armed()
    0
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import math
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from commopt.native_libraries import find_extension

__all__ = ["armed", "deadline", "native"]

_lib: ctypes.CDLL | None = None
_loaded = False
_fallback_lock = threading.Lock()
_fallback_armed = [0]


def _find_library() -> Path | None:
    return find_extension("_deadline")


def native() -> ctypes.CDLL | None:
    """The loaded ``commopt_ext._deadline`` library, or None where it was not built."""
    global _lib, _loaded
    if _loaded:
        return _lib
    _loaded = True
    path = _find_library()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.commopt_deadline_arm.restype = ctypes.c_int64
        lib.commopt_deadline_arm.argtypes = [
            ctypes.c_double,
            ctypes.c_char_p,
            ctypes.c_int64,
            ctypes.c_int,
        ]
        lib.commopt_deadline_disarm.restype = None
        lib.commopt_deadline_disarm.argtypes = [ctypes.c_int64]
        lib.commopt_deadline_count.restype = ctypes.c_int64
        lib.commopt_deadline_count.argtypes = []
    except (OSError, AttributeError):  # pragma: no cover - a broken or foreign build
        return None
    _lib = lib
    return lib


def armed() -> int:
    """How many deadlines are armed now (for tests)."""
    lib = native()
    return int(lib.commopt_deadline_count()) if lib is not None else _fallback_armed[0]


@contextlib.contextmanager
def deadline(seconds: float, message: str) -> Iterator[None]:
    """Within ``seconds``, the block ends, or the process does, after writing ``message``."""
    if math.isinf(seconds):
        yield
        return
    lib = native()
    if lib is not None:
        data = message.encode("utf-8", "replace")
        token = lib.commopt_deadline_arm(float(seconds), data, len(data), 1)
        if token > 0:
            try:
                yield
            finally:
                lib.commopt_deadline_disarm(token)
            return
    with _fallback(seconds):
        yield


@contextlib.contextmanager
def _fallback(seconds: float) -> Iterator[None]:
    """faulthandler's one process-wide clock: the first of concurrent blocks arms it."""
    with _fallback_lock:
        mine = _fallback_armed[0] == 0
        _fallback_armed[0] += 1
        if mine:
            faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        with _fallback_lock:
            _fallback_armed[0] -= 1
            if mine:
                faulthandler.cancel_dump_traceback_later()
