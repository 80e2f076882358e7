"""Soak: many steps of each training mode, watching what a leak would grow.

Starts ``--ranks`` ranks with mpirun (loopback); each rank trains a small MLP for ``--steps``
steps in every mode, one after another, each mode on a communicator of its own that is
finalized before the next starts:

* ``overlap``: float32 gradients, reduced bucket by bucket during backward;
* ``double_buffering``: the average of step t applied at step t+1;
* ``compensated``: compensated double buffering;
* ``qsgd4+ef``: 4-bit QSGD with error feedback (scatter-reduce/allgather through the codec);
* ``hierarchical``: the ranks on fake nodes of two (``COMMOPT_NODE_NAME``), reduced within each
  node, then across nodes, then broadcast back.

Every ``--every`` steps each rank samples its resident set size, its threads (the operating
system's count, which includes MPI's and torch's own, and Python's), its open file
descriptors and the MPI communicators commopt holds. After ``--warmup`` steps every sample
must stay within ``--tolerance`` (relative) of the first one after warm-up; the JSON record
says, per mode, rank and metric, the samples and whether they stayed flat, and how many MPI
communicators a rank still held once the mode's optimizer and communicator were finalized
and collected (``mpi_comms_kept``).

    python benchmarks/soak.py --out benchmarks/results/soak.json
    python benchmarks/soak.py --ranks 2 --steps 200 --warmup 100 --modes overlap  # short
    python benchmarks/soak.py --out benchmarks/results/soak.json --doc docs/reliability.md

Exits 1 when a metric did not stay flat (or a rank failed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from commopt.bench import harness

MODES = ("overlap", "double_buffering", "compensated", "qsgd4+ef", "hierarchical")
METRICS = ("rss_kib", "os_threads", "py_threads", "open_fds", "mpi_comms")
#: the worker's lines on stdout start with this, so MPI's own output cannot be mistaken.
TAG = "SOAK "


# ----------------------------------------------------------------------------- one rank


def _status_field(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {name} field")


def sample() -> dict[str, int]:
    """This process's resident memory (KiB), threads, open descriptors and MPI communicators."""
    from commopt.comm.mpi.transport import live_mpi_communicators

    return {
        "rss_kib": _status_field("VmRSS"),
        "os_threads": _status_field("Threads"),
        "py_threads": threading.active_count(),
        "open_fds": len(os.listdir("/proc/self/fd")),
        "mpi_comms": live_mpi_communicators(),
    }


def _optimizer(mode: str, model, comm):
    import torch

    import commopt

    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    options: dict = {"model": model, "bucket_cap_mb": 0.1}
    if mode == "double_buffering":
        options["double_buffering"] = True
    elif mode == "compensated":
        options["double_buffering"] = "compensated"
    elif mode == "qsgd4+ef":
        options["compression"] = "qsgd4+ef"
    elif mode == "hierarchical":
        options["algorithm"] = "hierarchical"
    return commopt.create_multi_node_optimizer(inner, comm, **options)


def run_mode(mode: str, steps: int, every: int, width: int) -> dict:
    """Train ``steps`` steps in ``mode`` on a fresh communicator; the samples and the seconds."""
    import torch

    import commopt

    if mode == "hierarchical":  # two ranks per fake node, read when the communicator starts
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        os.environ["COMMOPT_NODE_NAME"] = f"soak-node{rank // 2}"
    comm = commopt.create_communicator("mpi")
    os.environ.pop("COMMOPT_NODE_NAME", None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )
    opt = _optimizer(mode, model, comm)
    gen = torch.Generator().manual_seed(1000 + comm.rank)
    samples = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(32, 64, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step % every == 0:
            samples.append({"step": step, **sample()})
    seconds = time.perf_counter() - start
    if mode in ("double_buffering", "compensated"):
        opt.flush()
    weights = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    finite = bool(torch.isfinite(weights).all())
    opt.close()
    comm.finalize()
    return {
        "samples": samples,
        "seconds": seconds,
        "skipped_steps": opt.skipped_steps,
        "weights_finite": finite,
        "after_finalize": sample(),
    }


def run_and_release(mode: str, steps: int, every: int, width: int) -> dict:
    """``run_mode``, then a sample once its objects are gone (what a leak would keep)."""
    run = run_mode(mode, steps, every, width)
    gc.collect()
    run["after_release"] = sample()
    return run


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)  # several ranks share the cores
    before = sample()
    out = {"before": before, "modes": {}}
    for mode in args.modes:
        out["modes"][mode] = run_and_release(mode, args.steps, args.every, args.width)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    record = json.dumps({"rank": rank, **out})
    if args.records:  # a file per rank: long lines from several ranks interleave on stdout
        Path(args.records, f"rank{rank}.json").write_text(record)
    else:
        sys.stdout.write(TAG + record + "\n")
        sys.stdout.flush()


# ----------------------------------------------------------------------------- the judge


def flatness(samples: list[dict], warmup: int, tolerance: float) -> dict[str, dict]:
    """Per metric: the samples after ``warmup`` steps, their spread, and whether it is flat.

    Flat: every sample after warm-up is within ``tolerance`` (relative) of the first one.

        >>> s = [{"step": 100, "rss_kib": 500}, {"step": 200, "rss_kib": 1000},
        ...      {"step": 300, "rss_kib": 1020}]
        >>> flatness(s, 150, 0.05)["rss_kib"]["flat"]
        True
        >>> flatness(s, 0, 0.05)["rss_kib"]["flat"]
        False
    """
    kept = [s for s in samples if s["step"] > warmup]
    result = {}
    for metric in METRICS:
        values = [s[metric] for s in kept if metric in s]
        if not values:
            continue
        base = values[0]
        worst = max(abs(v - base) for v in values)
        rel = worst / base if base else (0.0 if worst == 0 else float("inf"))
        result[metric] = {
            "first": base,
            "last": values[-1],
            "min": min(values),
            "max": max(values),
            "max_rel_change": rel,
            "flat": rel <= tolerance,
        }
    return result


def judge(ranks: list[dict], warmup: int, tolerance: float) -> dict:
    """Per mode and rank: the flatness of every metric; ``passed`` when all are flat."""
    modes: dict[str, dict] = {}
    passed = True
    for r in ranks:
        for mode, run in r["modes"].items():
            flat = flatness(run["samples"], warmup, tolerance)
            ok = all(m["flat"] for m in flat.values()) and run["weights_finite"]
            # MPI communicators still held once the mode's objects are gone (finalized, freed)
            kept = run["after_release"]["mpi_comms"] - r["before"]["mpi_comms"]
            passed = passed and ok
            entry = modes.setdefault(
                mode, {"ranks": {}, "seconds": [], "passed": True, "mpi_comms_kept": 0}
            )
            entry["ranks"][str(r["rank"])] = {"metrics": flat, "passed": ok, "mpi_comms_kept": kept}
            entry["seconds"].append(round(run["seconds"], 2))
            entry["passed"] = entry["passed"] and ok
            entry["mpi_comms_kept"] = max(entry["mpi_comms_kept"], kept)
    return {"passed": passed, "modes": modes}


def launch(args: argparse.Namespace) -> dict:
    script = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    script += ["--modes", ",".join(args.modes), "--steps", str(args.steps)]
    script += ["--every", str(args.every), "--width", str(args.width)]
    script += ["--warmup", str(args.warmup)]
    records = Path(tempfile.mkdtemp(prefix="commopt-soak-"))
    script += ["--records", str(records)]
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(Path(__file__).resolve().parents[1]))}
    load0 = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        harness.mpirun(args.ranks, script, env=env, timeout=args.timeout)
        failure = ""
    except harness.RankJobFailed as exc:
        failure = str(exc)
    wall = time.perf_counter() - start
    ranks = [json.loads(path.read_text()) for path in sorted(records.glob("rank*.json"))]
    shutil.rmtree(records, ignore_errors=True)
    if failure or len(ranks) != args.ranks:
        raise SystemExit(
            f"soak: {len(ranks)} of {args.ranks} ranks' results; "
            f"{failure[-4000:] or 'mpirun exited 0'}"
        )
    ranks.sort(key=lambda r: r["rank"])
    verdict = judge(ranks, args.warmup, args.tolerance)
    return {
        "command": harness.command_line(__file__),
        "date": harness.utc_now(),
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_start": round(load0, 2),
            "load_average_end": round(os.getloadavg()[0], 2),
        },
        "ranks": args.ranks,
        "steps": args.steps,
        "every": args.every,
        "warmup": args.warmup,
        "tolerance": args.tolerance,
        "wall_s": round(wall, 1),
        **verdict,
        "per_rank": ranks,
    }


BEGIN, END = "<!-- soak: begin -->", "<!-- soak: end -->"
_LABELS = {
    "rss_kib": "RSS (MiB)",
    "os_threads": "threads (OS)",
    "py_threads": "threads (Python)",
    "open_fds": "open fds",
    "mpi_comms": "MPI communicators",
}


def section(record: dict) -> str:
    """The soak section of docs/reliability.md, from a record alone."""
    host = record["host"]
    lines = [
        BEGIN,
        "## Soak: days of running, in minutes",
        "",
        f"`{record['command']}` on {record['date']}: {record['ranks']} ranks (mpirun, "
        f"loopback) sharing the {host['cpus']} cores of one host (load average "
        f"{host['load_average_start']}-{host['load_average_end']}), {record['steps']} steps of a "
        f"small MLP per mode, each mode on a communicator of its own. Every {record['every']} "
        "steps each rank sampled its resident memory, threads, open file descriptors and the "
        f"MPI communicators commopt holds; after {record['warmup']} steps of warm-up every sample "
        f"must stay within {record['tolerance']:.0%} of the first one. Each cell: the range over "
        "all ranks' samples after warm-up, and the largest change of one rank (relative to its "
        f"first sample). Result file: `benchmarks/results/soak.json`; {record['wall_s']} s in all.",
        "",
        "| mode | s per rank | " + " | ".join(_LABELS.values()) + " | flat | MPI comms kept |",
        "|---" * (len(_LABELS) + 4) + "|",
    ]
    for mode, entry in record["modes"].items():
        cells = []
        for metric in _LABELS:
            per = [r["metrics"][metric] for r in entry["ranks"].values() if metric in r["metrics"]]
            lo, hi = min(m["min"] for m in per), max(m["max"] for m in per)
            worst = max(m["max_rel_change"] for m in per)
            if metric == "rss_kib":
                lo, hi = f"{lo / 1024:.1f}", f"{hi / 1024:.1f}"
            span = f"{lo}" if lo == hi else f"{lo}-{hi}"
            cells.append(f"{span} ({worst:.2%})")
        seconds = max(entry["seconds"])
        verdict = "yes" if entry["passed"] else "**no**"
        row = [f"`{mode}`", f"{seconds}", *cells, verdict, str(entry["mpi_comms_kept"])]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "*MPI comms kept*: communicators a rank still held once the mode's optimizer and "
        "communicator were closed, finalized and garbage collected (0 when nothing leaks).",
    ]
    lines += [
        "`hierarchical`'s intra- and inter-node communicators "
        "(`commopt.comm.topology.hierarchy`) belong to the communicator they were split off: "
        "its `finalize()` frees them.",
    ]
    kept = [m for m, e in record["modes"].items() if e["mpi_comms_kept"]]
    if kept:
        lines.append(
            f"**Kept** by {', '.join(f'`{m}`' for m in kept)}: MPI communicators that "
            "outlived their mode (a job that builds many communicators would run out of them)."
        )
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_section(text: str, page: Path, begin: str, end: str) -> None:
    """Put ``text`` (from ``begin`` to ``end``) in ``page``: in place of the old one, or last."""
    old = page.read_text() if page.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + text.rstrip("\n") + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    page.write_text(new)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000, help="steps per mode")
    ap.add_argument("--every", type=int, default=100, help="sample every this many steps")
    ap.add_argument("--warmup", type=int, default=500, help="steps before the flatness check")
    ap.add_argument("--tolerance", type=float, default=0.05, help="relative; 0.05 is 5%%")
    ap.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {MODES}")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    ap.add_argument("--out", help="write the JSON record here")
    ap.add_argument("--doc", help="write the soak section of this page from the --out record")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--records", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    if args.every < 1 or args.steps < 2 * args.every:
        ap.error("--every must be >= 1 and leave at least two samples (--steps >= 2 * --every)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.doc:  # only renders: python benchmarks/soak.py --out RECORD --doc PAGE
        record = json.loads(Path(args.out).read_text())
        write_section(section(record), Path(args.doc), BEGIN, END)
        return 0
    record = launch(args)
    if args.out:
        harness.write_json(args.out, record)
    for mode, entry in record["modes"].items():
        kept = entry["mpi_comms_kept"]
        print(
            f"{mode}: {'flat' if entry['passed'] else 'NOT FLAT'}, seconds per rank "
            f"{entry['seconds']}"
            + (f"; {kept} MPI communicators kept after release" if kept else "")
        )
    print(f"soak {'passed' if record['passed'] else 'FAILED'} in {record['wall_s']} s")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
