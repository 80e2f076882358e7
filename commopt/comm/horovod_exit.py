"""When a Horovod rank leaves early, its peers say which rank left (Horovod over MPI).

Horovod shuts itself down at exit, and a peer waiting in a Horovod operation then gets
``HorovodInternalError: Horovod has been shut down``, which names no rank; and a peer that
is not in a Horovod operation, or a shutdown that stalls, can leave the job waiting in
MPI_Finalize. When Horovod runs over MPI, :func:`install` (the first top-level Horovod
communicator calls it) adds, on a private duplicate of COMM_WORLD, one message from every
rank to every other (a 4-byte code, :func:`departure_reason`), sent when the rank *stops*
starting Horovod operations: as it leaves (at exit), or as it learns that another rank left.

* A rank that leaves sends its notice, waits until every peer has stopped (sent its own
  message), then shuts Horovod down as Horovod would at exit, so peers in an operation fail
  at once; then every rank meets the others in a non-blocking barrier, as the ``mpi``
  transport's exit handshake does. At a normal end they all arrive at once; a rank left
  waiting longer than $COMMOPT_EXIT_TIMEOUT seconds (default 30, the stop and the barrier
  together) aborts the job with a message naming itself.
* A peer reads the notices before it starts every Horovod operation (:func:`starting`),
  and while it waits for one (:class:`DepartureWatch`): once one arrived it starts none
  (it raises :class:`PeerLeftError`, which names the ranks that left; a
  ``HorovodInternalError`` too, for Horovod's handlers) and sends its own message, "stopped".
  An operation that fails because Horovod shut down raises the same error.
* Why a departing rank waits for its peers to stop before it shuts Horovod down: an
  operation started while Horovod's shutdown finalizes its queue either never gets a result
  (Horovod checks for its shutdown, then queues, without a lock between the two) or freezes
  the rank: the starting thread holds the GIL and waits for Horovod's process-set lock,
  which the shutting-down background thread holds while it frees the queued tensors, which
  takes the GIL (Horovod 0.28.1, torch 2.x). A frozen rank runs no Python at all. A wait
  that still gets no result raises a :data:`DEPARTURE_GRACE_S` seconds after the notice.
* The window left: a peer that neither starts nor waits for a Horovod operation within the
  exit timeout (a long computation) is not waited for; the departing rank then shuts Horovod
  down, and if that peer's next operation races the shutdown it may freeze, as above. The
  departing rank's exit barrier then aborts the job at the bound, with its message naming
  itself as the rank that left.

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
    "starting",
]

_TAG = 7301  # the messages' tag on the private communicator
_NO_ERROR, _UNCAUGHT, _STOPPED = 0, 1, 2
_REASONS = {
    _NO_ERROR: "ended without an error: its script returned or called sys.exit",
    _UNCAUGHT: "ended with an uncaught exception (its traceback is in its log)",
    _STOPPED: "stopped: another rank left",
}
_comm: Any = None  # the private COMM_WORLD duplicate (mpi4py's Intracomm)
_hvd_mod: Any = None  # horovod.torch
_received: dict[int, int] = {}  # source rank -> code of the messages read so far
_state = {"uncaught": False, "abort": False}
_lock = threading.Lock()  # one reader of the messages at a time (worker threads may fail together)
#: Held while a Horovod operation starts (:func:`starting`) and while this rank stops: once it
#: has announced that it stopped, no thread of it is inside, or enters, a Horovod start call.
_gate = threading.Lock()
_sends: list[Any] = []  # this rank's message to each peer, once it stopped (MPI requests)
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
    """Read the messages that arrived (waiting up to ``wait_s`` for a departure notice)."""
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
        if _left() or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _left() -> dict[int, int]:
    """The ranks that left (their departure notices read so far): rank -> code."""
    return {r: c for r, c in _received.items() if c != _STOPPED}


def _announce(code: int) -> None:
    """Send this rank's one message to every peer (once): it starts no Horovod operation from
    now on. The caller holds ``_gate``, so no thread of this rank is starting one."""
    if _sends:
        return
    import numpy as np

    MPI = sys.modules["mpi4py.MPI"]
    me, size = _comm.Get_rank(), _comm.Get_size()
    message = np.array([code], dtype=np.int32)
    _sends.extend(
        _comm.Isend([message, MPI.INT32_T], dest=r, tag=_TAG) for r in range(size) if r != me
    )


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
    left = _left()
    if left:
        who = "; ".join(f"rank {r} {departure_reason(c)}" for r, c in sorted(left.items()))
    else:  # only peers that stopped because of it so far
        who = "; ".join(f"rank {r} stopped because a rank left" for r in sorted(_received))
    return (
        f"rank {rank}: a Horovod operation failed because another rank left the job ({who}) "
        f"while this rank still waited for it. Every rank must make the same collective calls: "
        f"ranks that run out of data early keep stepping inside "
        f"`with commopt.Join(optimizer):`. [{detail}]"
    )


@contextlib.contextmanager
def starting(what: str):
    """Around the call that starts a Horovod operation: it is not made once a peer left (or
    this rank stopped); PeerLeftError names the rank instead. See the module's docstring."""
    if _comm is None:
        yield
        return
    with _gate:
        _read_notices(wait_s=0.0)
        if _received or _sends:
            _announce(_STOPPED)
            if not _left():
                _read_notices(
                    wait_s=2.0
                )  # a peer stopped: the notice of the rank that left follows
            raise PeerLeftError(
                _departure_message(f"Horovod's {what} was not started: a peer left the job")
            )
        yield


class DepartureWatch:
    """While one operation is waited for: whether a peer left and its grace ran out.

    ``check()`` (cheap to call often) reads the messages that arrived, without blocking. The
    first one makes this rank stop (it tells its peers, so that the rank that left shuts Horovod
    down and the operation fails at once); :data:`DEPARTURE_GRACE_S` seconds after it, with the
    operation still unfinished, it raises PeerLeftError. Nothing happens where the messages
    are not installed (one rank, Horovod over Gloo).
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
            with _gate:
                _announce(_STOPPED)
        if time.monotonic() - self._seen > DEPARTURE_GRACE_S:
            raise PeerLeftError(
                _departure_message(
                    f"Horovod's {self._what} got no result within {DEPARTURE_GRACE_S:g}s of "
                    f"the notice"
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
    from commopt.comm.mpi.runtime import EXIT_TIMEOUT_ENV, exit_timeout, wait_or_abort

    me, size = _comm.Get_rank(), _comm.Get_size()
    limit = exit_timeout()
    deadline = time.monotonic() + limit
    with _gate:  # (a rank that stopped earlier sent its message then)
        _announce(_UNCAUGHT if _state["uncaught"] else _NO_ERROR)
    # Horovod's shutdown must not race a peer's start of an operation (module docstring): wait
    # until every peer stopped, within the exit timeout.
    while len(_received) < size - 1 and time.monotonic() < deadline:
        _read_notices(wait_s=0.0)
        time.sleep(0.005)
    _hvd_mod.shutdown()  # what Horovod does at exit, now: peers in an operation fail at once
    wait_or_abort(
        _comm.Ibarrier(),
        max(0.0, deadline - time.monotonic()),
        f"commopt: rank {me} of {size} left the job (its script returned or called "
        f"sys.exit) and shut Horovod down, but other ranks have not left after "
        f"{limit:g}s (${EXIT_TIMEOUT_ENV}); it aborts the job so that none waits "
        f"forever. Ranks that run out of data early: train inside "
        f"`with commopt.Join(optimizer):`.\n",
    )
    # Every peer sent its one message before it entered the barrier: read the ones still unread.
    import numpy as np

    for r in range(size):
        if r != me and r not in _received:
            got = np.zeros(1, dtype=np.int32)
            _comm.Recv([got, MPI.INT32_T], source=r, tag=_TAG)
    MPI.Request.Waitall(_sends)
