"""Processor time of the mpi communicator's waits: CPU, wall time and wake-ups per allreduce.

    $ python benchmarks/mpi_wait_cpu.py --links 1gbit,40gbit --rounds 2 --out OUT.json

Each round runs every variant on every link, interleaved (variant A, B, C... then again), so
that load from other jobs falls on all of them alike. A variant is an environment for the
ranks (how the worker thread waits for MPI):

- ``polled``: sleeps that double from 10 us up to COMMOPT_MPI_POLL_SLEEP_US (200 us);
- ``paced``: the same, but a wait that expects to last (the previous segment's wait) sleeps
  half of what it expects to remain, then a quarter... before it polls (COMMOPT_MPI_WAIT=paced);
- ``spin``: MPI_Wait (Open MPI spins in its progress loop);
- ``spin-yield``: MPI_Wait with ``mpi_yield_when_idle`` (sched_yield between progress calls).

Per rank: ``--iters`` fp32 allreduces of ``--size`` bytes after 2 warm-ups; process CPU time
(all threads, getrusage) and the voluntary context switches of all its threads, per
allreduce. ``40gbit`` stands in for an unshaped link: the same namespaces and TCP path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from commopt.bench import harness

PY = sys.executable
VARIANTS = {  # polled is the default
    "polled": {"COMMOPT_MPI_WAIT": "polled"},
    "paced": {"COMMOPT_MPI_WAIT": "paced"},
    "spin": {"COMMOPT_MPI_WAIT": "spin"},
    "spin-yield": {"COMMOPT_MPI_WAIT": "spin", "OMPI_MCA_mpi_yield_when_idle": "1"},
}

RANK = r"""
import json, os, resource, sys, time
import torch
import commopt
size, iters, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
comm = commopt.create_communicator("mpi")
buf = torch.randn(size // 4)

def switches():
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    total += int(line.split()[1])
    return total

def cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime

for _ in range(2):
    comm.allreduce(buf)
comm.barrier()
c0, s0, t0 = cpu(), switches(), time.perf_counter()
for _ in range(iters):
    comm.allreduce(buf)
wall, c1, s1 = time.perf_counter() - t0, cpu(), switches()
mine = {"rank": comm.rank, "wall_s": wall / iters, "cpu_s": (c1 - c0) / iters,
        "wakes": (s1 - s0) / iters}
everyone = comm.allgather_obj(mine)
if comm.rank == 0:
    with open(out, "w") as f:
        json.dump(everyone, f)
"""


def run_once(args, variant: str, link: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="commopt-waitcpu-") as tmp:
        out = Path(tmp) / "out.json"
        script = Path(tmp) / "rank.py"
        script.write_text(RANK)
        rank = [PY, str(script), str(args.size), str(args.iters), str(out)]
        try:
            harness.launch(2, rank, link=link, timeout=300, env=VARIANTS[variant])
        except harness.RankJobFailed as exc:
            raise RuntimeError(f"{variant} {link}: {exc}") from None
        if not out.exists():
            raise RuntimeError(f"{variant} {link}: the ranks wrote no {out.name}")
        ranks = json.loads(out.read_text())
    return {
        "variant": variant,
        "link": link,
        "environment": VARIANTS[variant],
        "ranks": ranks,
        "load_average": os.getloadavg()[0],
    }


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for link in dict.fromkeys(r["link"] for r in runs):
        for variant in dict.fromkeys(r["variant"] for r in runs):
            mine = [r for r in runs if r["link"] == link and r["variant"] == variant]
            if not mine:
                continue

            def med(key):
                return statistics.median(statistics.mean(q[key] for q in r["ranks"]) for r in mine)

            rows.append(
                {
                    "link": link,
                    "variant": variant,
                    "rounds": len(mine),
                    "wall_ms": 1e3 * med("wall_s"),
                    "cpu_ms": 1e3 * med("cpu_s"),
                    "wakes": med("wakes"),
                    "load": [round(r["load_average"], 1) for r in mine],
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["link", "wait", "wall ms / allreduce", "rank CPU ms / allreduce"]
    head += ["wake-ups / allreduce", "load"]
    cells = [
        [
            r["link"],
            r["variant"],
            f"{r['wall_ms']:.1f}",
            f"{r['cpu_ms']:.1f}",
            f"{r['wakes']:.0f}",
            ", ".join(map(str, r["load"])),
        ]
        for r in rows
    ]
    return harness.table(head, cells, markdown=True, align="l" * len(head))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="1gbit,40gbit")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--size", type=int, default=16 << 20, help="bytes of fp32 (16 MiB)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--from", dest="from_")
    args = ap.parse_args(argv)
    if args.from_:
        doc = json.loads(Path(args.from_).read_text())
    else:
        unknown = set(args.variants.split(",")) - set(VARIANTS)
        if unknown:
            ap.error(
                f"unknown --variants {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}"
            )
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        runs = []
        for rnd in range(args.rounds):
            for link in args.links.split(","):
                for variant in args.variants.split(","):
                    runs.append({**run_once(args, variant, link), "round": rnd})
                    r = runs[-1]
                    print(
                        f"round {rnd} {link} {variant}: load {r['load_average']:.1f}",
                        file=sys.stderr,
                        flush=True,
                    )
        doc = {
            "command": harness.command_line(__file__, argv),
            "size": args.size,
            "iters": args.iters,
            "started": started,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "runs": runs,
        }
        doc["summary"] = summarize(runs)
        if args.out:
            harness.write_json(args.out, doc)
    print(markdown(doc.get("summary") or summarize(doc["runs"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
