"""Where one training step's processor time goes: per thread, per phase, from py-spy and /proc.

Two sources, each doing what it does best:

* ``/proc/<pid>/task/<tid>/stat``: the CPU time (user + system) of every thread of the
  process, Python or not (gloo's transport threads, the autograd and OpenMP threads), read
  before and after the profiled steps. This is the truth for "how much".
* ``py-spy record --native --format raw --threads`` (sampling, outside the process): the
  Python and native stacks of the Python threads. Each sample is attributed to a phase by
  the names of its frames (:data:`PHASE_RULES`, innermost frame first) and to a thread by
  its thread id, which py-spy prints as the OS thread id. This is the truth for "on what".

A thread's CPU time is split over the phases in proportion to its samples (py-spy counts a
runnable thread waiting for a core as active: on a shared machine its raw counts overstate
the CPU). No instrumentation in the code being measured: phases come from function names.
The table and the plot: :mod:`commopt.bench.profile_report`.

    >>> classify(
    ...     [
    ...         "<module> (x.py:1)",
    ...         "step (commopt/optim/multi_node.py:400)",
    ...         "unpack (commopt/reducer.py:410)",
    ...         "at::native::copy_ (libtorch_cpu.so)",
    ...     ]
    ... )
    'unpack'
    >>> classify(
    ...     [
    ...         "_issue (commopt/reducer.py:335)",
    ...         "pack (commopt/reducer.py:223)",
    ...         "torch::autograd::THPVariable_isfinite (libtorch_python.so)",
    ...     ]
    ... )
    'NaN check'
    >>> classify(
    ...     [
    ...         "pack (commopt/reducer.py:223)",
    ...         "torch::autograd::THPVariable_sum (libtorch_python.so)",
    ...     ]
    ... )
    'NaN check'
    >>> thread_role("commopt-collectives_0"), thread_role("MainThread")
    ('collectives driver', 'training')
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

#: The phases, in the order the table and the plot show them.
PHASES = (
    "forward",
    "backward",
    "pack",
    "NaN check",
    "encode",
    "send/receive",
    "wait/poll",
    "decode",
    "unpack",
    "apply",
    "commopt Python",
    "other",
)

#: (phase, substrings): a frame belongs to the first phase one of whose substrings it
#: contains; a sample to the phase of its innermost frame that belongs to one. Frames read
#: ``function (path/file.py:line)`` for Python and ``symbol (library.so)`` for native code.
PHASE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("NaN check", ("isfinite", "nonfinite", "_may_overflow (commopt/")),
    (
        "wait/poll",
        (
            "MPI_Test",
            "MPI_Wait",
            "opal_progress",
            "PMPI_Test",
            "PMPI_Wait",
            "Work::wait",
            "is_completed",
            "Work.wait",
            "wait (commopt/",
            "done (commopt/",
            "result (concurrent/",
            "_poll",
        ),
    ),
    (
        "decode",
        (
            "commopt_qsgd_decode",
            "commopt_cast_decode",
            "decode (commopt/",
            "decode_scaled (commopt/",
            "decompress (torch/distributed/algorithms",
        ),
    ),
    # DDP's hooks: what is not decompress is compression (PowerSGD's P, Q and error feedback)
    (
        "encode",
        (
            "commopt_qsgd_encode",
            "commopt_cast_encode",
            "encode (commopt/",
            "/ddp_comm_hooks/",
            "_orthogonalize",
        ),
    ),
    # unpack before pack: "unpack (" contains "pack ("
    ("unpack", ("unpack (commopt/", "Reducer::finalize_backward", "Reducer::finalize_bucket")),
    (
        "pack",
        (
            "pack_nonfinite",
            "pack (commopt/",
            "zero_grads_into (commopt/",
            "Reducer::mark_variable_ready",
            "Reducer::copy_grad_to_bucket",
            "Reducer::autograd_hook",
        ),
    ),
    (
        "send/receive",
        (
            "gloo::",
            "ProcessGroupGloo",
            "c10d::",
            "mpi4py",
            "MPI_",
            "ompi_",
            "mca_",
            "(commopt/comm/",
            "all_reduce (torch/distributed",
            "allreduce (torch/distributed",
        ),
    ),
    ("apply", ("(torch/optim/", "_single_tensor_sgd", "_multi_tensor_sgd")),
    # not "autograd::" alone: torch's Python bindings of every op are torch::autograd::THPVariable_*
    (
        "backward",
        (
            "autograd::Engine",
            "autograd::generated",
            "Backward",
            "AccumulateGrad",
            "backward (torch/",
            "_engine_run_backward",
        ),
    ),
    ("forward", ("(torch/nn/modules/", "forward (", "_call_impl (torch/")),
    ("commopt Python", ("(commopt/",)),
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


#: The reducer sums a bucket only to check it (``isfinite(flat.sum())``): a native sum called
#: straight from its Python is the NaN check, whatever line it sits on.
_CHECK_SUM = (("(commopt/reducer.py",), ("THPVariable_sum", "at::_ops::sum", "sum_kernel"))


def classify(frames: list[str]) -> str:
    """The phase of one sample whose stack is ``frames`` (outermost first)."""
    python = [i for i, f in enumerate(frames) if ".py:" in f]
    if (
        python
        and any(n in frames[python[-1]] for n in _CHECK_SUM[0])
        and any(n in f for f in frames[python[-1] + 1 :] for n in _CHECK_SUM[1])
    ):
        return "NaN check"
    for frame in reversed(frames):
        for phase, needles in PHASE_RULES:
            if any(n in frame for n in needles):
                return phase
    return "other"


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


# ----------------------------------------------------------------------------- py-spy


def pyspy_path() -> str:
    """The py-spy executable (next to this interpreter, else on PATH), or a clear error."""
    here = Path(sys.executable).with_name("py-spy")
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        raise RuntimeError(
            "the step profile needs py-spy: pip install py-spy (or pip install 'commopt[dev]')"
        )
    return found


class PySpy:
    """``py-spy record`` of this process from ``start()`` to ``stop()`` (raw collapsed stacks).

    ``--idle`` keeps every sample: which ones are a thread asleep is decided here
    (:func:`is_blocked`), so the samples of a thread cover the whole window.

    Native stacks make py-spy pause the process for each sample (a few tens of microseconds);
    ``rate`` samples per second bound that cost.
    """

    def __init__(self, out: Path, rate: int = 100, native: bool = True):
        self.out, self.rate, self.native = Path(out), rate, native
        self.proc: subprocess.Popen | None = None
        self.log = self.out.with_suffix(".log")

    def start(self, settle_s: float = 1.0) -> None:
        argv = [
            pyspy_path(),
            "record",
            "--pid",
            str(os.getpid()),
            "--format",
            "raw",
            "--threads",
            "--idle",
            "--rate",
            str(self.rate),
            "--output",
            str(self.out),
        ]
        if self.native:
            argv.append("--native")
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        time.sleep(settle_s)  # attaching takes a moment; samples before the steps are few
        if self.proc.poll() is not None:
            raise RuntimeError(f"py-spy stopped at once: {self.log.read_text()[-500:]}")

    def stop(self, timeout_s: float = 60) -> str:
        """Stop sampling; the raw output's text."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise RuntimeError(f"py-spy did not stop within {timeout_s} s") from None
        if not self.out.exists():
            raise RuntimeError(f"py-spy wrote no output: {self.log.read_text()[-500:]}")
        return self.out.read_text(errors="replace")


def parse_raw(text: str) -> list[tuple[int, str, list[str], int]]:
    """py-spy's raw output with ``--threads``: (tid, thread name, frames outermost first, count).

    >>> parse_raw("thread (42): MainThread;f (a.py:1);g (a.py:2) 7\\n")
    [(42, 'MainThread', ['f (a.py:1)', 'g (a.py:2)'], 7)]
    """
    out = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack.startswith("thread (") or not count.isdigit():
            continue
        head, _, rest = stack.partition(";")
        tid = int(head[len("thread (") : head.index(")")])
        name = head.split(": ", 1)[1] if ": " in head else ""
        out.append((tid, name, rest.split(";") if rest else [], int(count)))
    return out


#: Native functions a thread sleeps in: a sample inside one is a blocked thread, not CPU
#: (py-spy's own idle test misses them when libc has no symbols: it counts them active).
BLOCKING = (
    "pthread_cond_wait",
    "pthread_cond_timedwait",
    "PyThread_acquire_lock_timed",
    "sem_wait",
    "sem_timedwait",
    "sem_clockwait",
    "epoll_wait",
    "__poll",
    "poll (libc",
    "select (libc",
    "nanosleep",
    "time_sleep",
    "condition_variable::wait",
    "condition_variable::__wait",
    "__futex",
    "futex_wait",
    "accept (libc",
    "recv (libc",
    "__libc_recv",
    "read (libc",
    "__libc_read",
)


def is_blocked(frames: list[str]) -> bool:
    """Whether the sample's innermost named native frames are a sleeping call."""
    named = [f for f in frames if not f.startswith("0x")]
    return any(b in f for f in named[-3:] for b in BLOCKING)


def attribute(samples, cpu: dict[int, tuple[str, float, int, int]]) -> dict:
    """Per thread: its CPU seconds (from /proc) and its samples per phase (from py-spy).

    Returns {tid: {"name", "os_name", "role", "cpu_s", "switches", "preempted", "samples": {phase: n},
    "blocked": {phase: n}, "unclassified": {innermost frame: n}}} for every thread that used
    CPU or was sampled. ``samples`` count the thread running (or runnable), ``blocked`` the
    thread asleep in a wait (:data:`BLOCKING`), by the phase it waits in.
    """
    threads: dict[int, dict] = {}

    def new(name, os_name, cpu_s, voluntary=0, involuntary=0):
        return {
            "name": name,
            "os_name": os_name,
            "cpu_s": cpu_s,
            "switches": voluntary,
            "preempted": involuntary,
            "samples": Counter(),
            "blocked": Counter(),
            "unclassified": Counter(),
        }

    for tid, (os_name, *counts) in cpu.items():
        threads[tid] = new(os_name, os_name, *counts)
    for tid, name, frames, count in samples:
        t = threads.setdefault(tid, new(name, "", 0.0))
        t["name"] = name or t["name"]
        phase = classify(frames)
        (t["blocked"] if is_blocked(frames) else t["samples"])[phase] += count
        if phase == "other" and frames and not is_blocked(frames):
            t["unclassified"][" <- ".join(f.split(" (")[0] for f in frames[-3:][::-1])] += count
    for t in threads.values():
        t["role"] = thread_role(t["name"])
        for key in ("samples", "blocked"):
            t[key] = dict(t[key])
        t["unclassified"] = dict(t["unclassified"].most_common(8))
    return {tid: t for tid, t in threads.items() if t["cpu_s"] > 0 or t["samples"]}
