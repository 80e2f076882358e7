"""What commopt's torch.profiler ranges cost with no profiler running.

Run on 2 ranks (``mpirun -n 2 python benchmarks/profiler_overhead.py --out FILE``): each rank
times double-buffered qsgd4+ef steps of a small MLP with the ranges as shipped and with
them replaced by nothing, in interleaved rounds, and counts the ranges a step opens. The
bound that does not depend on the machine's noise is calls per step x cost per call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import timeit

import torch

import commopt
from commopt import profiling
from commopt.bench import harness
from commopt.collectives import plans
from commopt.reducer import gradient_reducer, reduction

MODULES = (plans, gradient_reducer, reduction)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    comm = commopt.create_communicator("mpi")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
    )
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        comm,
        model=model,
        compression="qsgd4+ef",
        double_buffering="stale",
        bucket_cap_mb=1,
    )
    x, y = torch.randn(16, 512), torch.randn(16, 512)

    def steps(n: int) -> float:
        comm.barrier() if hasattr(comm, "barrier") else None
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - t0) / n

    calls = 0
    real = profiling.phase

    def counting(name: str):
        nonlocal calls
        calls += 1
        return real(name)

    def nothing(name: str):
        return contextlib.nullcontext()

    def use(fn) -> None:
        for m in MODULES:
            m.phase = fn  # type: ignore[attr-defined]

    steps(5)
    use(counting)
    steps(args.steps)
    per_step = calls / args.steps
    shipped, stripped = [], []
    for _ in range(args.rounds):
        use(real)
        shipped.append(steps(args.steps))
        use(nothing)
        stripped.append(steps(args.steps))
    use(real)
    opt.flush()
    per_call = min(timeit.repeat(lambda: real("pack"), number=100_000, repeat=5)) / 100_000
    result = {
        "rank": comm.rank,
        "ranges_per_step": per_step,
        "phase_call_off_us": per_call * 1e6,
        "bound_us_per_step": per_step * per_call * 1e6,
        "step_ms_shipped": [t * 1e3 for t in shipped],
        "step_ms_without_ranges": [t * 1e3 for t in stripped],
        "median_ratio": statistics.median(shipped) / statistics.median(stripped),
    }
    outs = comm.allgather_obj(result)
    if comm.rank == 0:
        doc = {"command": harness.command_line(__file__), "ranks": outs}
        print(json.dumps(doc, indent=1))
        if args.out:
            harness.write_json(args.out, doc)


if __name__ == "__main__":
    main()
