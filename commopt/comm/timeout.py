"""The communication timeout: how long a collective may go without progress.

Every transport bounds its waits by one setting, ``timeout=`` of
:func:`commopt.create_communicator`, else ``$COMMOPT_COMM_TIMEOUT`` (seconds), else
:data:`DEFAULT_COMM_TIMEOUT_S`. ``0``, ``inf`` or ``off`` means no bound. What counts as
progress differs by transport (docs/reliability.md, "Links that fail"): commopt's own mpi
transport resets a peer's clock whenever bytes from it (or to it) complete a transfer, so a
slow link is not a dead one.

    >>> comm_timeout(environ={})
    600.0
    >>> comm_timeout(environ={"COMMOPT_COMM_TIMEOUT": "5"}), comm_timeout(30, environ={})
    (5.0, 30.0)
    >>> comm_timeout("off", environ={})
    inf

:class:`ProgressWatch` keeps the per-peer clocks of one communicator's collective in flight;
one watchdog thread per process (:func:`watch`) ends the job when a clock runs out.

    >>> now = [0.0]
    >>> w = ProgressWatch(5.0, rank=0, clock=lambda: now[0])
    >>> w.begin("allreduce (4.0 MiB)", [1, 2])
    >>> now[0] = 4.0; w.heard(1); now[0] = 6.0
    >>> w.stalled()
    [2]
    >>> print(w.message())  # doctest: +ELLIPSIS
    commopt: rank 0: allreduce (4.0 MiB) made no progress for 5s: nothing from rank 2 for 6.0s...
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable

__all__ = [
    "COMM_TIMEOUT_ENV",
    "DEFAULT_COMM_TIMEOUT_S",
    "ProgressWatch",
    "comm_timeout",
    "unwatch",
    "watch",
]

COMM_TIMEOUT_ENV = "COMMOPT_COMM_TIMEOUT"
#: Ten minutes without a byte: long enough for a 1 GiB bucket's slowest segment at 10 Mbit/s
#: (progress resets the clock, so only a silent link or a stopped peer runs it out), and
#: torch's own default for a process group.
DEFAULT_COMM_TIMEOUT_S = 600.0
_OFF = ("0", "off", "none", "inf", "infinity")


def comm_timeout(value: float | str | None = None, environ=None) -> float:
    """``value``, else $COMMOPT_COMM_TIMEOUT, else 600 s; ``inf`` when there is no bound."""
    environ = os.environ if environ is None else environ
    source = "timeout"
    if value is None:
        value, source = (
            environ.get(COMM_TIMEOUT_ENV, "") or DEFAULT_COMM_TIMEOUT_S,
            COMM_TIMEOUT_ENV,
        )
    text = str(value).strip().lower()
    if text in _OFF:
        return math.inf
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(
            f"{source}={value!r}: give the seconds a collective may go without progress, "
            f"e.g. 600, or 0/off for no bound"
        )
    return seconds


class ProgressWatch:
    """The clocks of one communicator's collective in flight, one per peer it waits for.

    ``begin`` starts a clock for every peer; ``heard(peer)`` restarts that peer's clock
    (bytes from or to it completed); ``settle(peer)`` stops it (the peer owes nothing more in
    this collective); ``end`` stops them all. Thread-safe: the communicator's worker updates
    it, the watchdog reads it.
    """

    def __init__(
        self,
        limit_s: float,
        *,
        rank: int,
        ranks_of: Callable[[Iterable[int]], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limit_s = float(limit_s)
        self.rank = rank
        self._ranks_of = ranks_of or (lambda peers: ", ".join(str(p) for p in peers))
        self._clock = clock
        self._lock = threading.Lock()
        self._what: str | None = None
        self._last: dict[int, float] = {}

    def begin(self, what: str, peers: Iterable[int]) -> None:
        now = self._clock()
        with self._lock:
            self._what = what
            self._last = dict.fromkeys(peers, now)

    def heard(self, peer: int) -> None:
        with self._lock:
            if peer in self._last:
                self._last[peer] = self._clock()

    def settle(self, peer: int) -> None:
        with self._lock:
            self._last.pop(peer, None)

    def end(self) -> None:
        with self._lock:
            self._what = None
            self._last = {}

    def stalled(self) -> list[int]:
        """The peers not heard from for longer than the limit, in this collective."""
        now = self._clock()
        with self._lock:
            return sorted(p for p, t in self._last.items() if now - t > self.limit_s)

    def message(self) -> str:
        now = self._clock()
        with self._lock:
            what, last = self._what, dict(self._last)
        late = sorted((p for p in last if now - last[p] > self.limit_s), key=lambda p: last[p])
        ages = "; ".join(
            f"nothing from rank {self._ranks_of([p])} for {now - last[p]:.1f}s" for p in late
        )
        return (
            f"commopt: rank {self.rank}: {what} made no progress for {self.limit_s:g}s: {ages} "
            f"(${COMM_TIMEOUT_ENV} or create_communicator(timeout=) sets the limit). The link "
            f"to {'that rank' if len(late) == 1 else 'those ranks'} is down, or "
            f"{'it' if len(late) == 1 else 'they'} stopped or never entered this collective; "
            f"ending the job."
        )


class _Watchdog:
    """One daemon thread per process while any bounded watch is registered: checks them all,
    ends the job once. It stops when the last watch is removed (finalize)."""

    def __init__(self):
        self._watches: weakref.WeakKeyDictionary[ProgressWatch, Callable[[str], None]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def add(self, w: ProgressWatch, on_stall: Callable[[str], None]) -> None:
        if math.isinf(w.limit_s):
            return
        with self._lock:
            self._watches[w] = on_stall
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), name="commopt-comm-watchdog", daemon=True
                )
                self._thread.start()

    def remove(self, w: ProgressWatch) -> None:
        with self._lock:
            self._watches.pop(w, None)
            if len(self._watches) or self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not threading.current_thread():
            thread.join()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._lock:
                items = list(self._watches.items())
            period = min([1.0] + [w.limit_s / 10 for w, _ in items])
            for w, on_stall in items:
                if w.stalled():
                    on_stall(w.message())
                    return
            stop.wait(period)


_WATCHDOG = _Watchdog()


def watch(w: ProgressWatch, on_stall: Callable[[str], None]) -> ProgressWatch:
    """Have the process's watchdog call ``on_stall(message)`` once ``w`` runs out (no-op for
    an unbounded watch); returns ``w``. ``on_stall`` must end the process."""
    _WATCHDOG.add(w, on_stall)
    return w


def unwatch(w: ProgressWatch) -> None:
    """The watchdog forgets ``w`` (its communicator was finalized)."""
    _WATCHDOG.remove(w)


def say(message: str) -> None:
    """Write ``message`` to stderr at once (the process is about to end)."""
    sys.stdout.flush()
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
