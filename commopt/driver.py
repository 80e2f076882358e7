"""The one owner of asynchrony: an ordered worker thread per communicator.

Every asynchronous reduction (the collectives' algorithm stages, the reducer's NaN/Inf
trailer, the DDP hook's unpacking) runs as a job on the worker of the communicator it
uses, in the order it was submitted. Every rank submits the same jobs in the same order,
so every rank issues the transport's collectives in the same order, whatever thread
produced the job (autograd's backward hooks, the optimizer's step, DDP's comm hook).

    >>> import commopt
    >>> from commopt import driver
    >>> comm = commopt.create_communicator("local")
    >>> seen = []
    >>> driver.then(comm, lambda: seen.append("after the reductions so far")).wait()
    >>> driver.drain(comm)  # nothing in flight any more
    >>> seen
    ['after the reductions so far']

A world of one with no worker yet runs the job at once on the caller's thread. A
stream-ordered communicator (``comm.stream_ordered``: pure_nccl, torch with nccl) never gets
a worker: its jobs run inline, on the calling thread, in issue order, with the
communicator's stream current after it waited for the caller's current stream
(:func:`commopt.comm.streams.issue_after_caller`); their Work is an event on that stream.
A host thread would see another current stream than the one that produced the data, and
would interleave the NCCL calls of two communicators in an order that can differ by rank.
The workers' threads are named ``commopt-collectives``; at interpreter exit every worker is
drained before the thread pools stop (see :func:`_drain_all_at_exit`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from commopt.comm.base import Communicator, CompletedWork, FutureWork, Work

__all__ = [
    "Driver",
    "drain",
    "driver_for",
    "idle",
    "on_device",
    "release_queued",
    "release_when_idle",
    "submit",
    "then",
]

_DONE = CompletedWork()


class Driver:
    """One thread that runs the jobs of one communicator in submission order."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commopt-collectives")
        self._lock = threading.Lock()
        self._last: FutureWork | None = None

    def submit(self, fn: Callable[[], None]) -> FutureWork:
        """Queue ``fn`` after every job submitted so far; returns its Work."""
        with self._lock:
            work = FutureWork(self._pool.submit(fn))
            self._last = work
            return work

    @property
    def last(self) -> FutureWork | None:
        """The Work of the job submitted last (None: none yet)."""
        with self._lock:
            return self._last

    def drain(self) -> None:
        """Wait for everything submitted so far (re-raises the last job's error)."""
        with self._lock:
            last = self._last
        if last is not None:
            last.wait()

    def shutdown(self) -> None:
        # Not wait=True: the last reference may drop on the worker thread itself.
        self._pool.shutdown(wait=False)


# Keyed weakly by communicator: a worker lives as long as its communicator.
_DRIVERS: weakref.WeakKeyDictionary[Communicator, Driver] = weakref.WeakKeyDictionary()
_DRIVERS_LOCK = threading.Lock()


def driver_for(comm: Communicator) -> Driver:
    """The worker of ``comm``, started on first use."""
    with _DRIVERS_LOCK:
        drv = _DRIVERS.get(comm)
        if drv is None:
            drv = _DRIVERS[comm] = Driver()
            # The thread must not outlive the communicator's resources.
            weakref.finalize(comm, drv.shutdown)
        return drv


def on_device(device: torch.device, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run with ``device`` current (the CUDA device is per thread; the worker's is 0)."""
    if device.type != "cuda":
        return fn

    def run() -> None:
        with torch.cuda.device(device):
            fn()

    return run


# Stream-ordered communicators: the last job's Work, for drain() (weakly keyed as above).
_LAST_INLINE: weakref.WeakKeyDictionary[Communicator, Work] = weakref.WeakKeyDictionary()


def _run_inline(
    comm: Communicator, fn: Callable[[], None], device: Any, keep: Sequence[Any]
) -> Work:
    from commopt.comm.streams import issue_after_caller

    # Only stream-ordered communicators (comm.streams) come here; the base class has no streams.
    ordered: Any = comm
    work = issue_after_caller(ordered.streams, ordered.codec_stream(device), device, fn, keep)
    _LAST_INLINE[comm] = work
    return work


def submit(
    comm: Communicator, fn: Callable[[], None], device: Any = None, keep: Sequence[Any] = ()
) -> Work:
    """Run ``fn`` on ``comm``'s worker after every job submitted on ``comm`` so far.

    ``fn`` may call ``comm``'s collectives (synchronously): it runs where the stages of
    the asynchronous allreduces run, so every rank still issues them in the same order.
    ``device``: the CUDA device ``fn`` works on, made current on the worker thread; on a
    CUDA device the job also starts after the caller's current stream reached this point
    and completes after its own kernels. A world
    of one that has no worker runs ``fn`` at once and returns a completed Work. A
    stream-ordered communicator runs ``fn`` at once, here, on its stream (``keep``: tensors
    that stream uses beyond ``fn``'s own allocations, kept alive until it is done).
    """
    if getattr(comm, "stream_ordered", False):
        return _run_inline(comm, fn, device, keep)
    if comm.size == 1 and _DRIVERS.get(comm) is None:
        fn()
        return _DONE
    if device is not None:
        dev = torch.device(device)
        fn = on_device(dev, fn)
        if dev.type == "cuda":
            fn = _in_stream_order(dev, fn)
    return driver_for(comm).submit(fn)


def _in_stream_order(device: torch.device, fn: Callable[[], None]) -> Callable[[], None]:
    """A host-ordered transport's job on CUDA buffers, ordered with the caller's stream.

    The worker thread's current stream is not the caller's: the job starts once the
    caller's current stream reached this point (an event recorded now, waited for on the
    worker), and it completes (its Work too) only once the kernels it enqueued finished, so
    the caller may use the results on any stream after ``wait()``.
    """
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))

    def run() -> None:
        ready.synchronize()
        fn()
        torch.cuda.current_stream(device).synchronize()

    return run


#: ``then(comm, fn)`` reads as what it is at the call sites that follow reductions (the
#: NaN/Inf trailer, the DDP hook's unpacking): the same ordered submission.
then = submit


def drain(comm: Communicator) -> None:
    """Wait until every job submitted on ``comm`` has finished (re-raises the last error).

    Stream-ordered communicators: blocks the host until the last job's stream work is done.
    """
    last = _LAST_INLINE.get(comm)
    if last is not None:
        last.synchronize()
        return
    drv = _DRIVERS.get(comm)
    if drv is not None:
        drv.drain()


def idle(comm: Communicator) -> bool:
    """Whether nothing submitted on ``comm`` is still running or queued."""
    last = _LAST_INLINE.get(comm)
    if last is None:
        drv = _DRIVERS.get(comm)
        last = drv.last if drv is not None else None
    return last is None or last.is_completed()


#: Communicators queued by :func:`release_when_idle`, finalized by :func:`release_queued`.
_QUEUED: deque[Communicator] = deque()


def release_when_idle(comm: Communicator) -> None:
    """Queue ``comm`` for :func:`release_queued` (an optimizer's private communicator).

    An optimizer's finalizer: the garbage collector runs it on any thread, at any moment,
    possibly while that thread holds a lock that releasing needs (a thread that is starting
    holds threading's own lock, which joining a thread takes), so it only queues; a
    ``deque.append`` takes no lock.
    """
    _QUEUED.append(comm)


def release_queued() -> None:
    """``finalize()`` the queued communicators, each as a job on its own worker, and wait.

    On its worker the release runs after every reduction already submitted on the
    communicator (a double-buffered one is still in flight when its optimizer is dropped), so
    it never strands the peers in a collective; it finalizes the communicators the queued one
    owns too (the hierarchy's intra/inter-node pair, :meth:`Communicator.adopt`). Called
    where the calling thread holds no lock: by the optimizer as it is created, steps and
    closes. A release that fails is left to MPI's exit (an unrelated optimizer does not fail).
    """
    works = []
    while _QUEUED:
        try:
            comm = _QUEUED.popleft()
        except IndexError:  # another thread took the last one
            break
        works.append(submit(comm, comm.finalize))
    for work in works:
        with contextlib.suppress(Exception):
            work.wait()


def _drain_all_at_exit() -> None:
    """Let reductions still in flight (double buffering) finish before the thread pools stop.

    Without this, interpreter shutdown refuses the transport's next submission on one rank
    while its peers already entered the collective: they would wait forever.
    """
    for drv in list(_DRIVERS.values()):
        with contextlib.suppress(Exception):
            drv.drain()


# Runs before concurrent.futures' own exit hook (these hooks run in reverse order).
_register_exit = getattr(threading, "_register_atexit", None)
if _register_exit is not None:
    _register_exit(_drain_all_at_exit)
else:  # pragma: no cover - CPython < 3.9
    import atexit

    atexit.register(_drain_all_at_exit)
