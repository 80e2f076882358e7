"""What every benchmark shares: starting ranks, timing, the result file and its facts.

`commopt bench` and the scripts in benchmarks/ use these pieces; a script adds only what it
measures. Four jobs:

- **starting ranks**: :func:`launch` runs a command on N ranks through ``commopt launch``
  (local ranks, MPI or torch gloo, optionally on emulated hosts joined by a shaped link);
  :func:`mpirun` runs it under this machine's ``mpirun`` with the test suite's loopback flags.
  Both raise :class:`RankJobFailed` (exit status and the end of stderr) when the job fails.
- **timing**: :func:`time_calls` times a call over repeats after warm-up calls (seconds per
  call, each repeat); :func:`best_seconds` / :func:`median_seconds` reduce them;
  :func:`interleaved_best` times several calls in alternation, so load from other processes
  hits all of them alike.
- **the result file**: :func:`record` starts a result document with the command that repeats
  the run, the date, the machine and the load average; :func:`write_json` writes it.
- **tables**: :func:`commopt.tables.table`, re-exported as :func:`table`.

    >>> command_line("benchmarks/x.py", ["--out", "r x.json"])
    "python benchmarks/x.py --out 'r x.json'"
    >>> sorted(record("benchmarks/x.py", [], size=4))
    ['command', 'date', 'load_average', 'machine', 'size']
    >>> best_seconds(lambda: None, repeats=3) >= 0
    True
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from commopt.tables import table

__all__ = [
    "RankJobFailed",
    "append_run",
    "bench_command_line",
    "best_seconds",
    "command_line",
    "cpu_model",
    "interleaved_best",
    "launch",
    "launch_command",
    "machine",
    "median_seconds",
    "mpirun",
    "record",
    "table",
    "threads_per_rank",
    "time_calls",
    "utc_now",
    "write_json",
]

#: The repository root (the scripts in benchmarks/ run their ranks from here).
REPO = Path(__file__).resolve().parents[2]


# -- facts of the machine and the run ---------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> str:
    """The CPU and its number of cores, as result files record it."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def utc_now() -> str:
    """The date and time in UTC, to the minute, as result files record it."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def command_line(script: str | os.PathLike[str], argv: Sequence[str] | None = None) -> str:
    """The shell command that repeats this run: ``python SCRIPT ARGS`` (``argv`` defaults to
    this process's arguments), ``SCRIPT`` relative to the repository when it is inside it."""
    path = Path(script)
    if path.is_absolute() and path.is_relative_to(REPO):
        path = path.relative_to(REPO)
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", shlex.quote(str(path)), *map(shlex.quote, args)])


def bench_command_line(name: str) -> str:
    """How ``commopt bench NAME`` was started: ``commopt bench NAME ARGS`` from the command
    line, else ``commopt bench NAME (from PROCESS ARGV)`` (e.g. run by a test or a script)."""
    argv = sys.argv[1:]
    if argv[:2] == ["bench", name]:
        return " ".join(["commopt", *map(shlex.quote, argv)])
    return f"commopt bench {name} (from " + " ".join(map(shlex.quote, sys.argv)) + ")"


def threads_per_rank(nprocs: int) -> int:
    """Torch threads for each of ``nprocs`` ranks sharing this machine's cores: one share each."""
    return max(1, (os.cpu_count() or 1) // nprocs)


def record(
    script: str | os.PathLike[str], argv: Sequence[str] | None = None, **fields: Any
) -> dict[str, Any]:
    """A result document's opening facts (``command``, ``date``, ``machine``,
    ``load_average`` now), then ``fields``."""
    return {
        "command": command_line(script, argv),
        "date": utc_now(),
        "machine": machine(),
        "load_average": round(os.getloadavg()[0], 2),
        **fields,
    }


def write_json(path: str | os.PathLike[str], doc: Any, *, indent: int = 1) -> Path:
    """``doc`` as JSON at ``path`` (folders made, a final newline); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=indent) + "\n")
    return out


def append_run(path: str | os.PathLike[str], run: dict[str, Any]) -> None:
    """Add ``run`` to the ``runs`` list of the result file at ``path`` (made if missing), so
    that an interrupted grid keeps what it finished and a rerun can skip it."""
    out = Path(path)
    data = json.loads(out.read_text()) if out.exists() else {"runs": []}
    data["runs"].append(run)
    write_json(out, data)


# -- timing -----------------------------------------------------------------------------------


def time_calls(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int = 1,
    calls: int = 1,
    sync: Callable[[], object] = lambda: None,
) -> list[float]:
    """Seconds per call of ``fn`` in each of ``repeats`` timings of ``calls`` calls, after
    ``warmup`` untimed calls; ``sync`` (e.g. ``torch.cuda.synchronize``) ends every timing."""
    if repeats < 1 or calls < 1:
        raise ValueError(f"time_calls needs repeats >= 1 and calls >= 1, got {repeats}, {calls}")
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append((time.perf_counter() - start) / calls)
    return out


def best_seconds(fn: Callable[[], object], repeats: int, **kw: Any) -> float:
    """The fastest of :func:`time_calls` (the least disturbed by other processes)."""
    return min(time_calls(fn, repeats=repeats, **kw))


def median_seconds(fn: Callable[[], object], repeats: int, **kw: Any) -> float:
    """The median of :func:`time_calls`."""
    return statistics.median(time_calls(fn, repeats=repeats, **kw))


def interleaved_best(fns: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The fastest time of each call, the calls taken in alternation (one warm-up each), so
    that load from other processes hits all of them alike."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


# -- starting ranks ---------------------------------------------------------------------------


class RankJobFailed(RuntimeError):
    """A job of ranks exited non-zero (the message ends with the tail of its stderr)."""


def launch_command(
    nprocs: int,
    command: Sequence[str],
    *,
    link: str | None = None,
    launcher: str | None = None,
    timeout: float | None = None,
) -> list[str]:
    """``commopt launch -n NPROCS [--launcher L] [--link RATE] [--timeout S] -- COMMAND``,
    run by this Python."""
    from commopt.commands.launch import launch_argv

    options: list[str] = []
    if launcher:
        options += ["--launcher", launcher]
    if link:
        options += ["--link", link]
    if timeout is not None:
        options += ["--timeout", f"{timeout:g}"]
    return launch_argv(nprocs, *options, "--", *command)


def _run(
    argv: list[str],
    what: str,
    *,
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike[str] | None,
    timeout: float | None,
    capture: bool,
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        argv,
        env=full_env,
        cwd=str(cwd or REPO),
        capture_output=capture,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-3000:] if capture else "(stderr above)"
        raise RankJobFailed(f"{what}: exit status {proc.returncode}\n{tail}")
    return proc


def launch(
    nprocs: int,
    command: Sequence[str],
    *,
    link: str | None = None,
    launcher: str | None = None,
    timeout: float = 600,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    capture: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` on ``nprocs`` ranks with ``commopt launch`` (see
    :func:`launch_command`) from ``cwd`` (default the repository), ``env`` added to this
    process's; ``timeout`` bounds the ranks, and the job a minute later. Raises
    :class:`RankJobFailed` when the job fails."""
    argv = launch_command(nprocs, command, link=link, launcher=launcher, timeout=timeout)
    return _run(argv, "commopt launch", env=env, cwd=cwd, timeout=timeout + 60, capture=capture)


def mpirun(
    nprocs: int,
    command: Sequence[str],
    *,
    timeout: float = 600,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    capture: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` on ``nprocs`` local ranks under ``mpirun`` (loopback TCP, the flags of
    the installed MPI's flavour); raises :class:`RankJobFailed` when the job fails."""
    from commopt.testbed.mpirun import mpirun_local_argv

    argv = mpirun_local_argv(nprocs, list(command))
    return _run(argv, "mpirun", env=env, cwd=cwd, timeout=timeout, capture=capture)
