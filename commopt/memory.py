"""Host memory: keep freed tensor memory for reuse instead of handing it back every step.

glibc's malloc serves blocks above its mmap threshold (at most 32 MiB) with fresh ``mmap``
calls and ``munmap``s them on free. A CPU training step frees and re-allocates its
gradients and activations, so every step page-faults its large tensors back in; the kernel
zeroes each page on the way. On the 25M-parameter benchmark model here that was 40 ms of
110 ms per step, all of it system time. PyTorch's performance tuning guide gives the usual
cure (an allocator that reuses memory: jemalloc or tcmalloc preloaded);
:func:`reuse_freed_memory` gets the same effect from glibc itself, from inside the process:

    >>> import commopt
    >>> commopt.reuse_freed_memory() in (True, False)  # False off glibc
    True

Call it once, early, in each training process. It is process-wide and never undone: freed
memory stays with the process (its peak stays resident), which is what a training loop
with a steady allocation pattern wants and a long-lived service with changing needs may not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["reuse_freed_memory"]

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

#: Free memory at the top of the heap glibc may keep before returning it to the OS
#: (mallopt takes an int: the largest one).
_KEEP_BYTES = 2**31 - 1


def reuse_freed_memory() -> bool:
    """Make glibc malloc reuse freed large blocks; True when applied, False off glibc.

    Sets ``M_MMAP_MAX = 0`` (large blocks come from the heap, not from fresh mappings), a
    trim threshold no heap reaches (freed memory is not returned to the OS) and one arena
    for threads started later. Surest before the process starts threads; from outside,
    the same is ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_ARENA_MAX=1``.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("commopt: no glibc mallopt here; preload jemalloc or tcmalloc instead")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success.
    ok = mallopt(_M_MMAP_MAX, 0) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1 and ok
    # Threads started from now on share the main heap: a per-thread arena is capped at
    # 64 MiB, so a larger block allocated there would still be a fresh mapping.
    ok = mallopt(_M_ARENA_MAX, 1) == 1 and ok
    return ok
