"""Where one training step's time goes: per thread, per phase, from torch.profiler and /proc.

Two sources, each doing what it does best:

* each thread's CPU-time clock (``/proc/<pid>/task/<tid>/stat`` where that is unavailable):
  the CPU time of every thread of the process, Python or not (gloo's transport threads, the
  autograd and OpenMP threads), read before and after the profiled steps, with its context
  switches. This is the truth for "how much CPU".
* a ``torch.profiler`` trace of the same steps (:func:`commopt.profiling.profile`, which
  records every thread), exported as a Chrome trace: each range and operator with its OS
  thread id, start and duration. This is the truth for "on what".

A range names its phase (:func:`phase_of`): commopt's own ``commopt.<phase>`` ranges, the
ranges the benchmark opens around the model's forward, backward and optimizer step
(:data:`STEP_RANGES`, :func:`step_range`), and the few ranges torch opens for DDP's reducer,
its collectives and its optimizers (:data:`TORCH_RANGES`). A thread's time in a phase is the
self-time of that phase's ranges on the thread: a range nested in another phase's range counts
for its own phase only, never twice (:func:`attribute`). Operators without a range of their
own belong to the range around them. The table and the plot:
:mod:`commopt.bench.profile_report`.

    >>> phase_of("commopt.encode"), phase_of("Optimizer.step#SGD.step"), phase_of("aten::mm")
    ('encode', 'apply', None)
    >>> thread_role("commopt-collectives_0"), thread_role("MainThread")
    ('collectives driver', 'training')
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from commopt.profiling import PHASES as COMMOPT_PHASES

#: The phases, in the order the table and the plot show them; "other" is a thread's time
#: outside every range that names a phase.
PHASES = (
    "forward",
    "backward",
    "pack",
    "encode",
    "transport",
    "wait",
    "decode",
    "agree",
    "unpack",
    "apply",
    "other",
)

#: The ranges the benchmark's worker opens around one step's parts (:func:`step_range`).
STEP_RANGES = {
    "bench.forward": "forward",
    "bench.backward": "backward",
    "bench.apply": "apply",
}

#: Ranges torch opens itself, by exact name: DDP's reducer copying gradients into its
#: buckets and the averages back, and its collectives, issued (``c10d::``) and run by gloo's
#: thread (``gloo:``). DDP's communication hooks open none: their compression runs inside
#: backward on the training thread, their decompression inside gloo's collective.
TORCH_RANGES = {
    "torch::distributed::reducer::copy_": "pack",
    "torch.distributed.ddp.reducer::copy_bucket_to_grad": "unpack",
}

#: Range name prefixes torch uses for whole families: every optimizer's step, every c10d
#: collective as issued, gloo's collectives as they run.
TORCH_PREFIXES = (
    ("Optimizer.step#", "apply"),
    ("c10d::", "transport"),
    ("gloo:", "transport"),
)

#: How thread names map to the rows of the table (anything else: "other threads").
THREAD_ROLES = (
    ("MainThread", "training"),
    ("commopt-collectives", "collectives driver"),
    ("commopt-mpi", "MPI worker"),
    ("gloo", "gloo transport"),
    ("pt_gloo", "gloo transport"),
    ("pt_autograd", "autograd"),
)


def phase_of(name: str) -> str | None:
    """The phase a range called ``name`` marks, or None (an operator, or a range of no phase)."""
    if name.startswith("commopt."):
        phase = name[len("commopt.") :]
        return phase if phase in COMMOPT_PHASES else None
    if name in STEP_RANGES:
        return STEP_RANGES[name]
    if name in TORCH_RANGES:
        return TORCH_RANGES[name]
    for prefix, phase in TORCH_PREFIXES:
        if name.startswith(prefix):
            return phase
    return None


def step_range(phase: str) -> contextlib.AbstractContextManager[Any]:
    """The benchmark's range around one part of a step (``forward``, ``backward``, ``apply``)."""
    import torch

    name = f"bench.{phase}"
    if name not in STEP_RANGES:
        raise ValueError(f"no step range for {phase!r}: one of {sorted(STEP_RANGES)}")
    return torch.profiler.record_function(name)


def thread_role(name: str) -> str:
    """The table's row for a thread called ``name`` (Python's name or the OS's ``comm``)."""
    for prefix, role in THREAD_ROLES:
        if name.startswith(prefix):
            return role
    return "other threads"


# ----------------------------------------------------------------------------- /proc


def _thread_clock(tid: int) -> int:
    # Linux's CPU-time clock of one thread of this process: MAKE_THREAD_CPUCLOCK(tid, SCHED).
    return (~tid << 3) | 6


def thread_cpu(pid: int | None = None) -> dict[int, tuple[str, float, int, int]]:
    """Every thread of this process: tid -> (OS name, CPU seconds so far, voluntary and
    involuntary context switches so far).

    A thread that waits by sleeping switches voluntarily once per wait; one preempted because
    another wants its core, involuntarily: many of those say the cores are oversubscribed.

    From each thread's CPU-time clock (nanoseconds; threads of this process only), else from
    ``/proc/.../stat`` (clock ticks: 10 ms, coarse for a few steps).
    """
    import time

    tick = os.sysconf("SC_CLK_TCK")
    own = pid is None or pid == os.getpid()
    out = {}
    root = Path(f"/proc/{pid or os.getpid()}/task")
    for task in root.iterdir():
        tid = int(task.name)
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        # "tid (comm) state ...": comm may hold spaces and parentheses; the last ')' ends it.
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        try:
            if not own:
                raise OSError
            cpu = time.clock_gettime(_thread_clock(tid))
        except OSError:
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick
        switches = [0, 0]
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    switches[0] = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    switches[1] = int(line.split()[1])
        except OSError:
            pass
        out[tid] = (name, cpu, switches[0], switches[1])
    return out


def cpu_delta(before: dict, after: dict) -> dict[int, tuple[str, float, int, int]]:
    """What each thread did between two :func:`thread_cpu` readings (a new thread: all)."""
    out = {}
    for tid, now in after.items():
        then = before.get(tid, (now[0], 0.0, 0, 0))
        out[tid] = (now[0], *(a - b for a, b in zip(now[1:], then[1:])))
    return out


# ----------------------------------------------------------------------------- the trace


def trace_events(path: str | Path) -> list[dict]:
    """The host-side ranges and operators of a Chrome trace ``torch.profiler`` exported:
    dicts with ``name``, ``tid`` (the OS thread id), ``ts`` and ``dur`` (microseconds)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return [
        {"name": e["name"], "tid": e["tid"], "ts": float(e["ts"]), "dur": float(e["dur"])}
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("cpu_op", "user_annotation")
        and isinstance(e.get("tid"), int)
    ]


def phase_seconds(events: list[dict]) -> dict[int, dict[str, float]]:
    """Per OS thread: seconds of self-time in each phase's ranges.

    On each thread, events nest by time; a range's phase gets the range's duration less the
    durations of the outermost phase ranges inside it (each counted for its own phase), so
    nested ranges are never counted twice. Operators and ranges of no phase only pass their
    time on to the phase range around them.

        >>> ev = [
        ...     {"name": "bench.backward", "tid": 7, "ts": 0, "dur": 100},
        ...     {"name": "aten::mm", "tid": 7, "ts": 5, "dur": 20},
        ...     {"name": "commopt.pack", "tid": 7, "ts": 30, "dur": 30},
        ...     {"name": "commopt.encode", "tid": 7, "ts": 40, "dur": 10},
        ... ]
        >>> {k: round(v * 1e6) for k, v in phase_seconds(ev)[7].items()}
        {'backward': 70, 'pack': 20, 'encode': 10}
    """
    out: dict[int, dict[str, float]] = {}
    by_thread: dict[int, list[dict]] = {}
    for e in events:
        by_thread.setdefault(int(e["tid"]), []).append(e)
    for tid, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        phases: dict[str, float] = {}
        # open phase ranges: (end, phase); an event inside one is nested in it
        stack: list[tuple[float, str]] = []
        for e in evs:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                stack.pop()
            phase = phase_of(e["name"])
            if phase is None:
                continue
            end = min(end, stack[-1][0]) if stack else end  # a range cut by its parent's end
            phases[phase] = phases.get(phase, 0.0) + (end - start) * 1e-6
            if stack:  # the enclosing phase loses this range's time
                parent = stack[-1][1]
                phases[parent] = phases.get(parent, 0.0) - (end - start) * 1e-6
            stack.append((end, phase))
        out[tid] = {p: s for p, s in phases.items() if s > 0}
    return out


def attribute(
    events: list[dict], cpu: dict[int, tuple[str, float, int, int]], names: dict[int, str]
) -> dict:
    """Per thread: its CPU seconds (its clock) and its seconds in each phase (the trace).

    ``cpu``: :func:`cpu_delta` over the profiled steps; ``names``: Python's names of the
    threads that have one (OS thread id -> name). Returns {tid: {"name", "os_name", "role",
    "cpu_s", "switches", "preempted", "phase_s": {phase: seconds}}} for every thread that
    used CPU or opened a phase range.
    """
    spent = phase_seconds(events)
    threads: dict[int, dict] = {}
    for tid in {*cpu, *spent}:
        os_name, cpu_s, voluntary, involuntary = cpu.get(tid, ("", 0.0, 0, 0))
        name = names.get(tid) or os_name
        threads[tid] = {
            "name": name,
            "os_name": os_name,
            "role": thread_role(name),
            "cpu_s": cpu_s,
            "switches": voluntary,
            "preempted": involuntary,
            "phase_s": spent.get(tid, {}),
        }
    return {tid: t for tid, t in threads.items() if t["cpu_s"] > 0 or t["phase_s"]}
