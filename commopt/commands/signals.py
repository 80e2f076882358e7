"""`commopt launch`'s signals: Ctrl-C, SIGTERM and SIGHUP stop the launch, never lost.

Imports nothing but :mod:`signal`, :mod:`sys` and :mod:`os` (loaded with the interpreter):
``python -m commopt launch`` installs the handlers before it imports anything else, so a signal
during start-up is handled like one that comes later.
"""

from __future__ import annotations

import os
import signal
import sys

TYPE_CHECKING = False  # (typing itself is not imported: start-up stays short)
if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "Terminated",
    "exit_status",
    "install_signal_handlers",
    "raise_if_signalled",
    "signal_behind",
]


class Terminated(SystemExit):
    """SIGTERM or SIGHUP, raised where the launcher is so the job is stopped in order."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)  # the shell's exit status for a signal
        self.signum = signum


#: The signals received since :func:`install_signal_handlers`, in order.
_received: list[int] = []


def install_signal_handlers() -> None:
    """Ctrl-C raises KeyboardInterrupt, SIGTERM/SIGHUP raise Terminated(signal) (exit 128 + signal).

    Installed first thing (``commopt/__main__.py``, before anything else is imported), so
    a signal that comes during start-up stops the launch like one that comes later. A signal
    the parent set to be ignored (``nohup``, a background job) stays ignored. Before that,
    during the interpreter's own start-up, Python's default Ctrl-C handler applies.

    Each handler also records its signal: Python drops an exception raised while it runs a
    callback (an import's module-lock callback prints "Exception ignored in ..."), and
    :func:`raise_if_signalled`, called before each step of the launch and while the job
    runs, raises it again.
    """

    def interrupted(signum, frame):
        _received.append(signum)
        raise KeyboardInterrupt

    def terminated(signum, frame):
        _received.append(signum)
        raise Terminated(signum)

    for sig, handler in (
        (signal.SIGINT, interrupted),
        (signal.SIGTERM, terminated),
        (signal.SIGHUP, terminated),
    ):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)


def raise_if_signalled() -> None:
    """Raise the exception of the first signal received, if any (see install_signal_handlers).

    >>> raise_if_signalled()  # no signal: nothing happens
    """
    if _received:
        signum = _received[0]
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)


def signal_behind(exc: BaseException) -> int | None:
    """The signal that stopped the launch while ``exc`` was raised, or None (not a signal).

    The first signal received, else the one ``exc`` stands for (KeyboardInterrupt: SIGINT).

    >>> signal_behind(ValueError("a bug")) is None
    True
    >>> signal_behind(KeyboardInterrupt()) == signal.SIGINT
    True
    """
    if _received:
        return _received[0]
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(exc, Terminated):
        return exc.signum
    return None


def exit_status(run: Callable[[], int]) -> int:
    """``run()``'s exit status for the launcher's process, decided when ``run()`` ends.

    A KeyboardInterrupt that escapes ``run()`` is 130, the shell's status for Ctrl-C (every
    ``finally`` on its way stopped the job and cleaned up). From then on Ctrl-C is ignored:
    nothing is left for it to stop. When a signal stopped the launch, the process ends here
    with that status (standard streams flushed): the interpreter's own exit may otherwise
    still end it by SIGINT (status -2) after a Ctrl-C it saw handled, as measured under load
    in about one run in ten of the fault matrix's Ctrl-C row.
    """
    code: int | None = None
    while True:
        try:
            if code is None:
                code = run()
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if _received:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            return code
        except KeyboardInterrupt:
            if code is None:
                code = 130
                print("commopt launch: interrupted; the job is stopped", file=sys.stderr)
