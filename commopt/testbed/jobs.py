"""Run a job's processes to the end: first failure stops the rest, a timeout stops all.

    >>> run_processes([["true"], ["sh", "-c", "exit 3"]], names=["rank 0", "rank 1"])
    3

Each process gets its own session, so a Ctrl-C at the terminal reaches only the launcher,
which then stops the job in order (SIGTERM, then SIGKILL after a grace period) before it
cleans up. Children also get SIGTERM if the launcher dies without that chance.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

TIMEOUT_EXIT = 124
GRACE_S = 5.0


#: Signals held back while a process starts, so that one is never half-started: a signal
#: that came meanwhile is taken once it is in the job (and is stopped with it).
_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # (the parent held them to start it)


def _say(msg: str) -> None:
    print(f"commopt launch: {msg}", file=sys.stderr, flush=True)


def stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM every process group still running; SIGKILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if p.poll() is None]
            time.sleep(0.02)
        if not alive:
            return


def run_processes(
    argvs: list[list[str]],
    *,
    envs: list[dict[str, str]] | None = None,
    names: list[str] | None = None,
    timeout: float | None = None,
    check: Callable[[], None] | None = None,
) -> int:
    """Start every argv, wait; return 0, the first non-zero exit code, or 124 on timeout.

    ``envs`` are added to this process's environment, one per argv. ``check`` is called
    before each start and while waiting: an exception it raises stops every process started
    and propagates (the launcher re-raises there a signal whose exception Python dropped).
    """
    names = names or [f"process {i}" for i in range(len(argvs))]
    procs: list[subprocess.Popen] = []
    try:
        for i, argv in enumerate(argvs):
            if check is not None:
                check()
            env = dict(os.environ, **(envs[i] if envs else {}))
            held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
            try:
                procs.append(
                    subprocess.Popen(
                        argv, env=env, start_new_session=True, preexec_fn=_die_with_parent
                    )
                )
            except FileNotFoundError as exc:
                _say(f"cannot start {names[i]}: {exc.filename} not found")
                stop(procs)
                return 127
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if check is not None:
                check()
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                if len(procs) > 1:
                    why = f"signal {-code}" if code < 0 else f"exit code {code}"
                    _say(f"{names[i]} ended with {why}; stopping the others")
                stop(procs)
                return 128 - code if code < 0 else code
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                _say(f"the job ran past --timeout {timeout:g}s; stopping it")
                stop(procs)
                return TIMEOUT_EXIT
            time.sleep(0.05)
    except BaseException:
        stop(procs)  # Ctrl-C, SIGTERM turned into an exception, or a bug: leave nothing behind
        raise
