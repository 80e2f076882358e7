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

    >>> classify(["<module> (x.py:1)", "step (commopt/optim/multi_node.py:400)",
    ...           "unpack (commopt/reducer.py:410)", "at::native::copy_ (libtorch_cpu.so)"])
    'unpack'
    >>> classify(["_issue (commopt/reducer.py:335)", "pack (commopt/reducer.py:223)",
    ...           "torch::autograd::THPVariable_isfinite (libtorch_python.so)"])
    'NaN check'
    >>> classify(["pack (commopt/reducer.py:223)", "torch::autograd::THPVariable_sum (libtorch_python.so)"])
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
PHASES = ("forward", "backward", "pack", "NaN check", "encode", "send/receive", "wait/poll",
          "decode", "unpack", "apply", "commopt Python", "other")

#: (phase, substrings): a frame belongs to the first phase one of whose substrings it
#: contains; a sample to the phase of its innermost frame that belongs to one. Frames read
#: ``function (path/file.py:line)`` for Python and ``symbol (library.so)`` for native code.
PHASE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("NaN check", ("isfinite", "nonfinite", "_may_overflow (commopt/")),
    ("wait/poll", ("MPI_Test", "MPI_Wait", "opal_progress", "PMPI_Test", "PMPI_Wait", "Work::wait",
                   "is_completed", "Work.wait", "wait (commopt/", "done (commopt/",
                   "result (concurrent/", "_poll")),
    ("decode", ("commopt_qsgd_decode", "commopt_cast_decode", "decode (commopt/",
                "decode_scaled (commopt/", "decompress (torch/distributed/algorithms")),
    ("encode", ("commopt_qsgd_encode", "commopt_cast_encode", "encode (commopt/",
                "powerSGD_hook (torch/", "compress_hook (torch/", "_orthogonalize")),
    # unpack before pack: "unpack (" contains "pack ("
    ("unpack", ("unpack (commopt/", "Reducer::finalize_backward", "Reducer::finalize_bucket")),
    ("pack", ("pack_nonfinite", "pack (commopt/", "zero_grads_into (commopt/",
              "Reducer::mark_variable_ready", "Reducer::copy_grad_to_bucket",
              "Reducer::autograd_hook")),
    ("send/receive", ("gloo::", "ProcessGroupGloo", "c10d::", "mpi4py", "MPI_", "ompi_",
                      "mca_", "(commopt/comm/", "all_reduce (torch/distributed",
                      "allreduce (torch/distributed")),
    ("apply", ("(torch/optim/", "_single_tensor_sgd", "_multi_tensor_sgd")),
    ("backward", ("autograd::", "backward (torch/", "_engine_run_backward", "Backward0")),
    ("forward", ("(torch/nn/modules/", "forward (", "_call_impl (torch/")),
    ("commopt Python", ("(commopt/",)),
)

#: How thread names map to the rows of the table (anything else: "other threads").
THREAD_ROLES = (("MainThread", "training"), ("commopt-collectives", "collectives driver"),
                ("commopt-mpi", "MPI worker"), ("gloo", "gloo transport"),
                ("pt_gloo", "gloo transport"), ("pt_autograd", "autograd"))


#: The reducer sums a bucket only to check it (``isfinite(flat.sum())``): a native sum called
#: straight from its Python is the NaN check, whatever line it sits on.
_CHECK_SUM = (("(commopt/reducer.py",), ("THPVariable_sum", "at::_ops::sum", "sum_kernel"))


def classify(frames: list[str]) -> str:
    """The phase of one sample whose stack is ``frames`` (outermost first)."""
    python = [i for i, f in enumerate(frames) if ".py:" in f]
    if python and any(n in frames[python[-1]] for n in _CHECK_SUM[0]) and any(
            n in f for f in frames[python[-1] + 1:] for n in _CHECK_SUM[1]):
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
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        try:
            if not own:
                raise OSError
            cpu = time.clock_gettime(_thread_clock(tid))
        except OSError:
            fields = stat[stat.rindex(")") + 2:].split()
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
        out[tid] = (name, cpu, *switches)
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
        raise RuntimeError("the step profile needs py-spy: pip install py-spy "
                           "(or pip install 'commopt[dev]')")
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
        argv = [pyspy_path(), "record", "--pid", str(os.getpid()), "--format", "raw",
                "--threads", "--idle", "--rate", str(self.rate), "--output", str(self.out)]
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
        tid = int(head[len("thread ("): head.index(")")])
        name = head.split(": ", 1)[1] if ": " in head else ""
        out.append((tid, name, rest.split(";") if rest else [], int(count)))
    return out


#: Native functions a thread sleeps in: a sample inside one is a blocked thread, not CPU
#: (py-spy's own idle test misses them when libc has no symbols: it counts them active).
BLOCKING = ("pthread_cond_wait", "pthread_cond_timedwait", "PyThread_acquire_lock_timed",
            "sem_wait", "sem_timedwait", "sem_clockwait", "epoll_wait", "__poll", "poll (libc",
            "select (libc", "nanosleep", "time_sleep", "condition_variable::wait",
            "condition_variable::__wait", "__futex", "futex_wait", "accept (libc", "recv (libc",
            "__libc_recv", "read (libc", "__libc_read")


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
        return {"name": name, "os_name": os_name, "cpu_s": cpu_s, "switches": voluntary,
                "preempted": involuntary,
                "samples": Counter(), "blocked": Counter(), "unclassified": Counter()}

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


#: Columns of the profile table: the phases, the CPU py-spy could not attribute (native
#: threads it does not sample), the thread's CPU and its time asleep.
COLUMNS = ("forward", "backward", "pack", "NaN check", "encode", "send/receive", "wait/poll",
           "decode", "unpack", "apply", "commopt Python", "other", "native")


def thread_rows(profile: dict) -> dict[str, dict[str, float]]:
    """One rank's profile -> role -> {phase or "native": CPU ms per step, "cpu", "blocked",
    "switches", "preempted" per step}; roles sorted training first.

    A thread's CPU (its clock) is split over phases by its running samples; a thread py-spy
    did not sample (gloo's, OpenMP's, autograd's native threads) counts as "native". Blocked
    ms: the thread's samples asleep in a wait, at the sampling's actual spacing (the window
    over the training thread's sample count).
    """
    steps = profile["steps"]
    threads = list(profile["threads"].values())
    main = [t for t in threads if t["role"] == "training"]
    main_samples = sum(sum(t["samples"].values()) + sum(t["blocked"].values()) for t in main)
    spacing_ms = 1e3 * profile["wall_s"] / main_samples if main_samples else 1e3 / profile["rate"]
    rows: dict[str, dict[str, float]] = {}
    for t in threads:
        row = rows.setdefault(t["role"], {})
        cpu_ms = 1e3 * t["cpu_s"] / steps
        running = sum(t["samples"].values())
        if running:
            for phase, n in t["samples"].items():
                row[phase] = row.get(phase, 0.0) + cpu_ms * n / running
        else:
            row["native"] = row.get("native", 0.0) + cpu_ms
        row["cpu"] = row.get("cpu", 0.0) + cpu_ms
        row["blocked"] = row.get("blocked", 0.0) + spacing_ms * sum(t["blocked"].values()) / steps
        row["switches"] = row.get("switches", 0.0) + t.get("switches", 0) / steps
        row["preempted"] = row.get("preempted", 0.0) + t.get("preempted", 0) / steps
    order = ["training", "collectives driver", "MPI worker", "gloo transport", "autograd", "other threads"]
    return {k: rows[k] for k in sorted(rows, key=lambda r: order.index(r) if r in order else 99)}


def waits(profile: dict, role: str = "training") -> dict[str, float]:
    """ms per step the ``role`` threads slept, by the phase they slept in."""
    rows = [t for t in profile["threads"].values() if t["role"] == role]
    total = sum(sum(t["samples"].values()) + sum(t["blocked"].values()) for t in rows)
    if not total:
        return {}
    spacing_ms = 1e3 * profile["wall_s"] / total if role == "training" else 1e3 / profile["rate"]
    out: dict[str, float] = {}
    for t in rows:
        for phase, n in t["blocked"].items():
            out[phase] = out.get(phase, 0.0) + spacing_ms * n / profile["steps"]
    return out


def profile_table(entries: list[tuple[str, dict, dict]], markdown: bool = False) -> str:
    """A table of ms per step: for each (label, rank's profile, row figures) its threads by
    phase and all threads together; under it, each step beside its floor.

        >>> prof = {"steps": 2, "rate": 100, "wall_s": 0.2, "threads": {"1": {
        ...     "role": "training", "cpu_s": 0.1, "samples": {"backward": 3, "pack": 1},
        ...     "blocked": {"wait/poll": 16}, "switches": 4, "preempted": 2}}}
        >>> text = profile_table([("x", prof, {"step_s": 0.1, "floor_s": 0.05})], markdown=True)
        >>> [c.strip() for c in text.splitlines()[2].split("|")[1:5]]
        ['x: training', '-', '38', '12']
        >>> text.splitlines()[-1]
        'x: profiled steps 100 ms on average; timed step 100 ms; floor 50 ms (timed step / floor 2.00x)'
    """
    from commopt._tables import table

    head = ("thread", *COLUMNS, "CPU", "asleep", "switches", "preempted")
    lines, notes = [], []
    fmt = lambda v: "-" if not v else f"{v:.1f}" if v < 10 else f"{v:.0f}"  # noqa: E731
    for label, prof, fig in entries:
        rows = thread_rows(prof)
        total: dict[str, float] = {}
        for role, row in rows.items():
            lines.append([f"{label}: {role}", *(fmt(row.get(c)) for c in COLUMNS), fmt(row["cpu"]),
                          fmt(row["blocked"]), fmt(row["switches"]), fmt(row["preempted"])])
            for k, v in row.items():
                total[k] = total.get(k, 0.0) + v
        lines.append([f"{label}: all threads", *(fmt(total.get(c)) for c in COLUMNS),
                      fmt(total.get("cpu")), "", fmt(total.get("switches")), fmt(total.get("preempted"))])
        note = [f"profiled steps {1e3 * prof['wall_s'] / prof['steps']:.0f} ms on average"]
        if fig.get("step_s"):
            note.append(f"timed step {fig['step_s'] * 1e3:.0f} ms")
            if fig.get("floor_s"):
                note.append(f"floor {fig['floor_s'] * 1e3:.0f} ms (timed step / floor "
                            f"{fig['step_s'] / fig['floor_s']:.2f}x)")
        notes.append(f"{label}: " + "; ".join(note))
    return "\n".join([table(head, lines, markdown=markdown), "", *notes])


# ----------------------------------------------------------------------------- reports

#: One colour per phase (and for the time asleep) in the stacked bars.
_COLOURS = {"forward": "#a6cee3", "backward": "#1f78b4", "pack": "#b2df8a", "NaN check": "#33a02c",
            "encode": "#fb9a99", "send/receive": "#e31a1c", "wait/poll": "#fdbf6f",
            "decode": "#ff7f00", "unpack": "#cab2d6", "apply": "#6a3d9a", "commopt Python": "#ffff99",
            "other": "#b15928", "native": "#999999"}


def report_entries(report: dict, rank: str = "0", link_label: bool = False) -> list[tuple[str, dict, dict]]:
    """(label, rank's profile, row figures) of every profiled configuration of a step report."""
    out = []
    link = (report.get("link_rate") or "unshaped") if link_label else None
    for model, info in report["models"].items():
        rows = {r["config"]: r for r in info.get("rows", [])}
        for config, raw in info.get("raw", {}).items():
            prof = (raw.get("profile") or {}).get(rank)
            if prof:
                label = f"{model} {config}" + (f" ({link})" if link else "")
                out.append((label, prof, rows.get(config, {})))
    return out


def plot_profile(entries: list[tuple[str, dict, dict]], path: str, title: str = "") -> None:
    """Stacked bars: each thread's CPU ms per step by phase and its time asleep, per profiled
    configuration, with the timed step and its floor marked."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the profile plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(entries), 1, figsize=(10, 1.2 + 1.15 * sum(
        len(thread_rows(p)) + 1 for _, p, _ in entries) / max(1, len(entries)) * len(entries) / 2.2),
        squeeze=False)
    right = 0.0
    for ax, (label, prof, figs) in zip(axes[:, 0], entries):
        rows = thread_rows(prof)
        names = list(rows)[::-1]
        for y, role in enumerate(names):
            left = 0.0
            for phase in COLUMNS:
                v = rows[role].get(phase, 0.0)
                if v:
                    ax.barh(y, v, left=left, color=_COLOURS[phase], label=phase, edgecolor="white", lw=0.3)
                    left += v
            if role == "training" and rows[role]["blocked"]:  # the step's wall time, all of it
                ax.barh(y, rows[role]["blocked"], left=left, color="white", edgecolor="#777777",
                        hatch="///", lw=0.5, label="asleep (waiting)")
                left += rows[role]["blocked"]
            right = max(right, left)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        step = figs.get("step_s")
        if step:
            ax.axvline(step * 1e3, color="k", lw=1.2, label="timed step (wall)")
            right = max(right, step * 1e3)
        if figs.get("floor_s"):
            ax.axvline(figs["floor_s"] * 1e3, color="k", ls="--", lw=1.2,
                       label="floor: max(compute + codec, link)")
        ax.set_title(label, fontsize=9, loc="left")
    for ax in axes[:, 0]:
        ax.set_xlim(0, right * 1.05)
    axes[-1, 0].set_xlabel("ms per step, one rank: CPU by phase (solid); the training thread's "
                           "time asleep (hatched)")
    legend = {}
    for ax in axes[:, 0]:
        for handle, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, handle)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.legend(list(legend.values()), list(legend), fontsize=7, loc="lower center", ncol=6,
               bbox_to_anchor=(0.5, 0.0))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    """Render the profiles of one or more saved step reports (``commopt bench step --profile
    --json ...``) as one table and one plot: shaped and unshaped side by side."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m commopt.bench.profile_step", description=main.__doc__)
    parser.add_argument("reports", nargs="+", help="JSON reports of commopt bench step --profile")
    parser.add_argument("--rank", default="0", help="whose profile (default rank 0)")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    parser.add_argument("--plot", metavar="PATH", help="write the stacked-bar PNG")
    args = parser.parse_args(argv)
    entries = []
    for path in args.reports:
        entries += report_entries(json.loads(Path(path).read_text()), args.rank,
                                  link_label=len(args.reports) > 1)
    if not entries:
        raise SystemExit("no profile in these reports: run commopt bench step with --profile")
    print(profile_table(entries))
    if args.markdown:
        Path(args.markdown).write_text(profile_table(entries, markdown=True) + "\n")
    if args.plot:
        plot_profile(entries, args.plot, title=f"rank {args.rank}; " + ", ".join(args.reports))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
