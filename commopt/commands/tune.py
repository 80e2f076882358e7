"""`commopt tune`: find the network settings that give the most all-reduce bandwidth.

    $ commopt tune -n 2 --link 1gbit --transport mpi           # emulated 1 Gbit/s link, Open MPI
    $ commopt tune -n 8 --transport nccl --out nccl.env        # NCCL socket threads x sockets
    $ commopt tune --grid btl_tcp_links=1,4 --grid btl_tcp_eager_limit=64K,1M -n 2 --dry-run
    $ commopt tune --runner "mpirun -np 16 --hostfile hosts" --transport mpi   # a real cluster

Each point of the grid runs `commopt bench allreduce --json` once (with the defaults as
the first point, to compare against), the points are ranked by bus bandwidth over the large
messages, the table is printed and the best setting is written as an env file to `source`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys

HELP = "sweep network settings with `commopt bench allreduce`; write the best as an env file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nprocs", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument(
        "--link",
        metavar="RATE",
        help="run on an emulated cluster joined by links of RATE (e.g. 1gbit; root)",
    )
    parser.add_argument("--ranks-per-host", type=int, metavar="K", help="ranks per emulated host")
    parser.add_argument(
        "--launcher",
        choices=("mpi", "torch"),
        default="mpi",
        help="how `commopt launch` starts the ranks (default mpi)",
    )
    parser.add_argument(
        "--runner",
        metavar="CMD",
        help="your own launcher prefix instead of `commopt launch` (e.g. "
        '"mpirun -np 16 --hostfile hosts"); the bench command is appended',
    )
    parser.add_argument(
        "--transport",
        choices=("mpi", "nccl"),
        default=None,
        help="the default grid and benchmark backend: mpi (Open MPI TCP links and "
        "eager limits) or nccl (socket threads x sockets per thread); "
        "default nccl with CUDA, else mpi",
    )
    parser.add_argument(
        "--grid",
        action="append",
        metavar="NAME=V1,V2",
        help="a swept variable (repeat for more; replaces the default grid). "
        "Lower-case names are Open MPI MCA parameters; A+B=... moves two "
        "together; values take K/M/G suffixes; '|' separates values with commas",
    )
    parser.add_argument(
        "--bench-args",
        default=None,
        metavar="ARGS",
        help="extra arguments for `commopt bench allreduce`, e.g. "
        '"-b 1M -e 64M -n 5 --codec fp16" (one codec)',
    )
    parser.add_argument(
        "--large-from",
        default="1M",
        metavar="SIZE",
        help="rank by mean busbw over messages of at least SIZE (default 1M)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="do not run the defaults (no variables set) as the first point",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="run each point R times, round-robin, and rank by the median "
        "busbw at each size (default 1; use 3 or more on a noisy network)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300,
        metavar="SECONDS",
        help="stop a point after SECONDS (default 300)",
    )
    parser.add_argument(
        "--out",
        default="commopt-tune.env",
        metavar="FILE",
        help="env file for the best setting (default commopt-tune.env)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the points and the command")


def _transport(args) -> str:
    if args.transport:
        return args.transport
    try:
        import torch

        return "nccl" if torch.cuda.is_available() else "mpi"
    except ImportError:  # pragma: no cover
        return "mpi"


def bench_argv(transport: str, extra: str | None) -> list[str]:
    """The benchmark each point runs."""
    # -c 0: no error check (an extra allreduce per size); later --bench-args override these.
    argv = [
        sys.executable,
        "-m",
        "commopt",
        "bench",
        "allreduce",
        "--json",
        "-c",
        "0",
        "--comm",
        "pure_nccl" if transport == "nccl" else "mpi",
    ]
    return argv + (shlex.split(extra) if extra else [])


def runner_argv(args) -> list[str]:
    if args.runner:
        return shlex.split(args.runner)
    # launch's own timeout stops a hung point cleanly; tune's (a little later) is the backstop.
    from commopt.commands.launch import launch_argv

    argv = launch_argv(args.nprocs, "--launcher", args.launcher, "--timeout", f"{args.timeout:g}")
    if args.link:
        argv += ["--link", args.link]
    if args.ranks_per_host:
        argv += ["--ranks-per-host", str(args.ranks_per_host)]
    return argv + ["--"]


def run(args: argparse.Namespace) -> int:
    from commopt.network import tune

    transport = _transport(args)
    try:
        points = tune.parse_grid(args.grid or tune.DEFAULT_GRIDS[transport])
        large_from = int(tune.parse_value(args.large_from))
    except ValueError as exc:
        print(f"commopt tune: {exc}", file=sys.stderr)
        return 2
    if args.bench_args and re.search(r"--codec[ =]\S*,", args.bench_args):
        print(
            "commopt tune: rank one codec at a time: --bench-args '--codec NAME'", file=sys.stderr
        )
        return 2
    runnable = []
    for p in points:
        reason = tune.skip_reason(p)
        if reason:
            print(f"skip {tune.describe(p)}: {reason}")
        else:
            runnable.append(p)
    if not args.no_baseline:
        runnable.insert(0, {})
    if not runnable:
        print("commopt tune: no point left to run", file=sys.stderr)
        return 2
    argv = runner_argv(args) + bench_argv(transport, args.bench_args)
    command = shlex.join(argv)
    print(f"{len(runnable)} points x {args.repeats} run(s), each: {command}")
    if args.dry_run:
        for p in runnable:
            print(f"  {tune.describe(p)}")
        return 0

    def progress(i, total, res):
        status = (
            f"{res.score(large_from):.4g} GB/s"
            if res.rows and not res.error
            else f"FAILED: {res.error}"
        )
        print(
            f"[{i}/{total}] {tune.describe(res.point)}: {status} ({res.seconds:.1f}s)", flush=True
        )

    if args.repeats < 1:
        print("commopt tune: --repeats must be at least 1", file=sys.stderr)
        return 2
    results = tune.sweep(
        runnable,
        argv,
        timeout=args.timeout + 30,
        repeats=args.repeats,
        progress=progress,
        large_from=large_from,
    )
    ranked = tune.rank(results, large_from)
    print()
    print(tune.format_table(ranked, large_from))
    best = ranked[0]
    if best.error or not best.rows:
        print("commopt tune: every point failed; nothing written", file=sys.stderr)
        return 1
    baseline = next((r for r in results if not r.point and r.rows), None)
    tune.write_env_file(
        args.out,
        tune.env_file_text(best, command=command, large_from=large_from, baseline=baseline),
    )
    print(f"\nbest: {tune.describe(best.point)} -> {args.out} (source it before launching)")
    return 0 if all(not r.error for r in results) else 1
