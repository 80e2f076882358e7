"""Overlap efficiency and peak memory of create_multi_node_optimizer, side by side.

Run (2 ranks, emulated hosts joined by a shaped link; needs root for the namespaces):

    python benchmarks/overlap.py --link 200mbit --ranks 2

It starts the ranks itself with ``commopt launch`` and prints a Markdown table:

* timing (one job, every mode measured in turn, repeated and interleaved, medians):
  compute only (forward + backward + update, no communication), communication only (the
  wrapper's reduce-and-update with no forward/backward), the wrapper with ``overlap=False``,
  ``overlap=True`` and ``double_buffering=True``, and PyTorch DDP. Target: double
  buffering <= 1.1 x max(compute, communication).
* peak memory (one job per mode, ``ru_maxrss`` of each rank, glibc told to hand large
  blocks back at once): the wrapper against DDP. Target: at most one extra gradient-sized
  buffer (double buffering), none otherwise.

Inside a job (``--rank-mode``) it is the program every rank runs; ``--comm torch`` (gloo)
is the default because gloo waits on sockets without spinning a core.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from commopt.bench import harness

REPO = Path(__file__).resolve().parents[1]
TIMED_MODES = ("compute", "communication", "no-overlap", "overlap", "double-buffering", "ddp")
MEMORY_MODES = ("ddp", "overlap", "double-buffering")


# -- what every rank runs ---------------------------------------------------------------------
def build_model(width: int, depth: int):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    import commopt

    comm = commopt.create_communicator(args.comm)
    model = build_model(args.width, args.depth)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)

    def loss_of(m):
        return torch.nn.functional.mse_loss(m(x), y)

    def plain_step(m, opt):
        opt.zero_grad()
        loss_of(m).backward()
        opt.step()

    def make(mode):
        """A zero-argument callable running one training step of ``mode``."""
        m = build_model(args.width, args.depth)
        if mode == "compute":
            opt = torch.optim.SGD(m.parameters(), lr=1e-6)
            return lambda: plain_step(m, opt)
        if mode == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(m)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
            return lambda: plain_step(ddp, opt)
        inner = torch.optim.SGD(m.parameters(), lr=1e-6)
        opt = commopt.create_multi_node_optimizer(
            inner,
            comm,
            overlap=(mode != "no-overlap"),
            double_buffering="stale" if mode == "double-buffering" else False,
            compression=args.compression,
            bucket_cap_mb=args.bucket_cap_mb,
        )
        if mode == "communication":
            for p in m.parameters():
                p.grad = torch.randn_like(p)
            return opt.step  # gradients stay: every call reduces and applies them
        return lambda: plain_step(m, opt)

    def sync():
        comm.barrier()

    if args.rank_mode == "memory":
        step = make(args.mode)
        for _ in range(args.steps):
            step()
        sync()
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        peaks = comm.allgather_obj(peak_mb)
        if comm.rank == 0:
            Path(args.out).write_text(
                json.dumps({"mode": args.mode, "peak_mb": peaks, "grad_mb": n_params * 4 / 2**20})
            )
        return

    steps = {mode: make(mode) for mode in TIMED_MODES if mode != "ddp" or dist.is_initialized()}
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for step in steps.values():  # warm-up (allocations, first broadcast, first stale step)
        for _ in range(2):
            step()
    for _ in range(args.repeats):
        for mode, step in steps.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            times[mode].append((time.perf_counter() - t0) / args.steps)
    if comm.rank == 0:
        med = {m: statistics.median(v) for m, v in times.items()}
        Path(args.out).write_text(
            json.dumps(
                {
                    "median_s": med,
                    "all_s": times,
                    "params": n_params,
                    "grad_mb": n_params * 4 / 2**20,
                }
            )
        )


# -- the driver: starts the jobs, prints the table ------------------------------------------------
def launch(args, rank_args: list[str], out: str) -> dict:
    rank = [sys.executable, str(Path(__file__).resolve()), "--out", out, "--comm", args.comm]
    rank += ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    rank += ["--steps", str(args.steps), "--repeats", str(args.repeats)]
    rank += ["--bucket-cap-mb", str(args.bucket_cap_mb), *rank_args]
    if args.compression:
        rank += ["--compression", args.compression]
    # glibc hands large blocks back at once: the peak RSS follows the live tensors.
    env = dict(PYTHONPATH=str(REPO), MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    harness.launch(
        args.ranks,
        rank,
        launcher="torch",
        link=args.link or None,
        timeout=args.timeout,
        env=env,
        capture=False,
    )
    return json.loads(Path(out).read_text())


def driver(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        timing = launch(args, ["--rank-mode", "time"], f"{tmp}/time.json")
        memory = {
            m: launch(args, ["--rank-mode", "memory", "--mode", m], f"{tmp}/mem-{m}.json")
            for m in MEMORY_MODES
        }
    med = timing["median_s"]
    compute, comm = med["compute"], med["communication"]
    bound = max(compute, comm)
    print(
        f"model: {args.depth} x Linear({args.width}, {args.width}), {timing['params'] / 1e6:.1f}M "
        f"parameters ({timing['grad_mb']:.0f} MiB of fp32 gradients), batch {args.batch} per rank, "
        f"{args.ranks} ranks, link {args.link or 'loopback'}, codec {args.compression or 'fp32'}, "
        f"bucket_cap_mb {args.bucket_cap_mb:g}"
    )
    print()
    print(
        harness.table(
            ["mode", "step time (ms)", "/ max(compute, communication)"],
            [
                [mode, f"{med[mode] * 1e3:.0f}", f"{med[mode] / bound:.2f}"]
                for mode in TIMED_MODES
                if mode in med
            ],
            markdown=True,
            align="lll",
        )
    )
    print(
        f"\nperfect overlap: max(compute, communication) = {bound * 1e3:.0f} ms; no overlap: "
        f"compute + communication = {(compute + comm) * 1e3:.0f} ms"
    )
    print()
    ddp_peak = max(memory["ddp"]["peak_mb"])
    grad = memory["ddp"]["grad_mb"]
    peaks = {mode: max(memory[mode]["peak_mb"]) for mode in MEMORY_MODES}
    print(
        harness.table(
            [
                "mode",
                "peak RSS per rank (MiB, max over ranks)",
                "vs DDP (MiB)",
                "vs DDP (gradient sizes)",
            ],
            [
                [mode, f"{peak:.0f}", f"{peak - ddp_peak:+.0f}", f"{(peak - ddp_peak) / grad:+.2f}"]
                for mode, peak in peaks.items()
            ],
            markdown=True,
            align="llll",
        )
    )
    print(f"\none gradient-sized buffer = {grad:.0f} MiB")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--link", default="200mbit", help="emulated link rate (tc syntax); '' for loopback"
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--comm", default="torch", help="communicator: torch (gloo) or mpi")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=4, help="steps per timed repetition")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compression", default=None, help="codec name, e.g. qsgd4 (default fp32)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--rank-mode", choices=("time", "memory"), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=TIMED_MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_mode:
        rank_main(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
