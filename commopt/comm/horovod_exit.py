"""When a Horovod rank leaves early, its peers say which rank left (Horovod over MPI).

Horovod shuts itself down at exit, and a peer waiting in a Horovod operation then gets
``HorovodInternalError: Horovod has been shut down``, which names no rank; and a peer that
is not in a Horovod operation, or a shutdown that stalls, can leave the job waiting in
MPI_Finalize. When Horovod runs over MPI, :func:`install` (the first top-level Horovod
communicator calls it) adds, on a private duplicate of COMM_WORLD:

* at exit, each rank sends every other rank a notice (a 4-byte code: why it leaves), then
  shuts Horovod down as Horovod would, so peers in an operation fail at once;
* a peer whose operation fails reads the notices and raises :class:`PeerLeftError`, which
  names the ranks that left (it is a ``HorovodInternalError`` too, for Horovod's handlers);
* a peer whose operation neither completes nor fails reads the notices while it waits
  (:class:`DepartureWatch`): Horovod checks for its shutdown before it queues an
  operation, so one started while the shutdown drains the queue never gets a result; a
  notice, then :data:`DEPARTURE_GRACE_S` seconds without a result, raise the same error;
* then every rank meets the others in a non-blocking barrier, as the ``mpi`` transport's
  exit handshake does: at a normal end they all arrive at once; a rank left waiting longer
  than $COMMOPT_EXIT_TIMEOUT seconds (default 30) aborts the job with a message naming itself.

Under ``horovodrun --gloo`` (no MPI) nothing is added: Horovod's own shutdown applies.

    >>> from commopt.comm.horovod_exit import departure_reason
    >>> departure_reason(0)
    'ended without an error: its script returned or called sys.exit'
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any

from commopt.comm.errors import CommError

__all__ = [
    "DEPARTURE_GRACE_S",
    "DepartureWatch",
    "PeerLeftError",
    "aborting",
    "departure_reason",
    "install",
    "naming_departures",
    "prepare_mpi",
]

_TAG = 7301  # the notices' tag on the private communicator
_NO_ERROR, _UNCAUGHT = 0, 1
_REASONS = {
    _NO_ERROR: "ended without an error: its script returned or called sys.exit",
    _UNCAUGHT: "ended with an uncaught exception (its traceback is in its log)",
}
_comm: Any = None  # the private COMM_WORLD duplicate (mpi4py's Intracomm)
_hvd_mod: Any = None  # horovod.torch
_received: dict[int, int] = {}  # source rank -> code of the notices read so far
_state = {"uncaught": False, "abort": False}
_lock = threading.Lock()  # one reader of the notices at a time (worker threads may fail together)
#: How long an operation may still wait for its result once a peer's departure notice is read:
#: Horovod's shutdown fails every queued operation at once, so only a lost one waits longer.
DEPARTURE_GRACE_S = 5.0


def departure_reason(code: int) -> str:
    """Words for a notice's code."""
    return _REASONS.get(code, f"left (code {code})")


def _launched_by_mpi() -> bool:
    env = os.environ
    if env.get("HOROVOD_CONTROLLER", "").lower() == "gloo" or env.get(
        "HOROVOD_GLOO_RENDEZVOUS_ADDR"
    ):
        return False
    return any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def prepare_mpi(hvd) -> None:
    """Before ``hvd.init()``: let mpi4py start MPI, so MPI outlives Horovod's shutdown.

    (Horovod finalizes MPI in its shutdown only when it started MPI itself; the exit
    barrier runs after that shutdown.) Nothing happens without an MPI launcher or mpi4py.
    """
    if not _launched_by_mpi() or not hvd.mpi_built():
        return
    try:
        from mpi4py import MPI  # noqa: F401  (initializes MPI, thread level MULTIPLE)
    except ImportError:  # pragma: no cover - depends on the environment
        return


def install(hvd) -> None:
    """After ``hvd.init()`` (a collective call on every rank, once): add the exit notices."""
    global _comm, _hvd_mod
    if _comm is not None or hvd.size() == 1 or not hvd.mpi_enabled():
        return
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return  # Horovod owns MPI and finalizes it in its shutdown: keep Horovod's behaviour
    from commopt.comm.mpi.runtime import exit_timeout

    exit_timeout()  # a bad value fails now, on every rank, not at exit
    _comm, _hvd_mod = MPI.COMM_WORLD.Dup(), hvd
    previous = sys.excepthook

    def note_uncaught(exc_type, exc, tb):
        _state["uncaught"] = True
        previous(exc_type, exc, tb)

    sys.excepthook = note_uncaught
    # Before Horovod's own atexit shutdown, and before worker threads are joined.
    threading._register_atexit(_leave)  # type: ignore[attr-defined]


class PeerLeftError(CommError):
    """A Horovod operation failed because another rank left the job (see :func:`explain`)."""


def _read_notices(wait_s: float) -> None:
    """Read the notices that arrived (waiting up to ``wait_s`` for a first one)."""
    MPI = sys.modules["mpi4py.MPI"]
    deadline = time.monotonic() + wait_s
    status = MPI.Status()
    with _lock:
        _read_locked(MPI, status, deadline)


def _read_locked(MPI, status, deadline: float) -> None:
    import numpy as np

    while True:
        if _comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
            code = np.zeros(1, dtype=np.int32)
            _comm.Recv([code, MPI.INT32_T], source=status.Get_source(), tag=_TAG)
            _received[status.Get_source()] = int(code[0])
            continue
        if _received or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def explain(exc: BaseException) -> BaseException:
    """``exc`` (Horovod's error), or a PeerLeftError naming the ranks that left if any did."""
    if _comm is None or "shut down" not in str(exc):
        return exc
    _read_notices(wait_s=2.0)  # the notice is sent before the shutdown that caused exc
    if not _received:
        return exc
    # Still what Horovod's own handlers catch.
    error_type = type("PeerLeftError", (PeerLeftError, type(exc)), {"__module__": __name__})
    return error_type(_departure_message(str(exc).splitlines()[0][:120]))


def _departure_message(detail: str) -> str:
    rank = _comm.Get_rank()  # the world rank: Horovod's global rank
    who = "; ".join(f"rank {r} {departure_reason(c)}" for r, c in sorted(_received.items()))
    return (
        f"rank {rank}: a Horovod operation failed because another rank left the job ({who}) "
        f"while this rank still waited for it. Every rank must make the same collective calls: "
        f"ranks that run out of data early keep stepping inside "
        f"`with commopt.Join(optimizer):`. [{detail}]"
    )


class DepartureWatch:
    """While one operation is waited for: whether a peer left and its grace ran out.

    ``check()`` (cheap to call often) reads the notices that arrived, without blocking, and
    raises PeerLeftError once :data:`DEPARTURE_GRACE_S` have passed since the first one was
    seen with the operation still unfinished. Nothing happens where the notices are not
    installed (one rank, Horovod over Gloo).
    """

    def __init__(self, what: str):
        self._what = what
        self._seen: float | None = None

    def check(self) -> None:
        if _comm is None:
            return
        if self._seen is None:
            _read_notices(wait_s=0.0)
            if not _received:
                return
            self._seen = time.monotonic()
        if time.monotonic() - self._seen > DEPARTURE_GRACE_S:
            raise PeerLeftError(
                _departure_message(
                    f"Horovod's {self._what} got no result within {DEPARTURE_GRACE_S:g}s of "
                    f"the notice: Horovod's shutdown lost it"
                )
            )


@contextlib.contextmanager
def naming_departures():
    """Around a Horovod call: its error becomes a PeerLeftError when a rank left (:func:`explain`)."""
    try:
        yield
    except RuntimeError as exc:
        err = explain(exc)
        if err is exc:
            raise
        raise err from exc


def abort_at_exit() -> None:
    """A Horovod operation timed out: at exit, abort the job instead of shutting Horovod down.

    Horovod's shutdown joins its background thread, which still waits in the operation that
    made no progress (a dead link): it would never return. ``MPI_Abort`` ends every rank.
    """
    _state["abort"] = True


def aborting() -> bool:
    """Whether an operation timed out (:func:`abort_at_exit`): the job is ending."""
    return _state["abort"]


def _leave() -> None:
    import numpy as np

    MPI = sys.modules.get("mpi4py.MPI")
    if _comm is None or MPI is None or MPI.Is_finalized():
        return
    if _state["abort"]:
        sys.stderr.write(
            f"commopt: rank {_comm.Get_rank()}: a Horovod operation made no progress within "
            "the communication timeout; aborting the job (Horovod's shutdown would wait on it)\n"
        )
        sys.stderr.flush()
        time.sleep(1.0)  # peers timing out at the same moment print their own error too
        MPI.COMM_WORLD.Abort(1)
    me, size = _comm.Get_rank(), _comm.Get_size()
    code = np.array([_UNCAUGHT if _state["uncaught"] else _NO_ERROR], dtype=np.int32)
    sends = [_comm.Isend([code, MPI.INT32_T], dest=r, tag=_TAG) for r in range(size) if r != me]
    _hvd_mod.shutdown()  # what Horovod does at exit, now: peers in an operation fail at once
    from commopt.comm.mpi.runtime import EXIT_TIMEOUT_ENV, exit_timeout, wait_or_abort

    limit = exit_timeout()
    wait_or_abort(
        _comm.Ibarrier(),
        limit,
        f"commopt: rank {me} of {size} left the job (its script returned or called "
        f"sys.exit) and shut Horovod down, but other ranks have not left after "
        f"{limit:g}s (${EXIT_TIMEOUT_ENV}); it aborts the job so that none waits "
        f"forever. Ranks that run out of data early: train inside "
        f"`with commopt.Join(optimizer):`.\n",
    )
    # Every peer sent its notice before it entered the barrier: read the ones still unread.
    for r in range(size):
        if r != me and r not in _received:
            got = np.zeros(1, dtype=np.int32)
            _comm.Recv([got, MPI.INT32_T], source=r, tag=_TAG)
    MPI.Request.Waitall(sends)
