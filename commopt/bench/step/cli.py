"""The command line of ``commopt bench step``: its options and what runs.

>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_arguments(parser)
>>> parser.parse_args(["--models", "tiny", "--no-link"]).rounds
3
"""

from __future__ import annotations

import argparse
import sys

from commopt.bench.step.configs import CONFIGS, POWERSGD_START_ITER, STEP_DEFAULT_CONFIGS
from commopt.bench.step.models import MODELS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `commopt bench step` (and the hidden ones of its ranks)."""
    parser.add_argument(
        "--models",
        default="mlp,cnn",
        help=f"comma-separated, from {', '.join(MODELS)} (default mlp,cnn)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(STEP_DEFAULT_CONFIGS),
        help="comma-separated configurations (default: "
        + ", ".join(STEP_DEFAULT_CONFIGS)
        + "); also: "
        + ", ".join(c for c in CONFIGS if c not in STEP_DEFAULT_CONFIGS),
    )
    parser.add_argument(
        "-n", "--nprocs", type=int, default=2, help="ranks, one per host (default 2)"
    )
    parser.add_argument(
        "--link",
        default="1gbit",
        help="rate of the emulated links between hosts (default 1gbit; needs root "
        "and network namespaces, else plain loopback, said so)",
    )
    parser.add_argument("--no-link", action="store_true", help="run on plain loopback, unshaped")
    parser.add_argument(
        "--launcher",
        choices=("torch", "mpi"),
        default="torch",
        help="how `commopt launch` starts the ranks (default torch)",
    )
    parser.add_argument(
        "--comm",
        choices=("torch", "mpi"),
        default="torch",
        help="commopt's communicator: torch (gloo, DDP's transport; default) or mpi "
        "(needs --launcher mpi)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="times the whole list of configurations runs, in turn (default 3)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="timed steps per configuration and round (default: the model's: "
        + ", ".join(f"{m} {s.steps}" for m, s in MODELS.items())
        + ")",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help=f"untimed steps first (default 3; PowerSGD compresses from step "
        f"{POWERSGD_START_ITER})",
    )
    parser.add_argument(
        "--block",
        type=int,
        help="timed steps between two compute-only measurements (default: the "
        "model's: " + ", ".join(f"{m} {s.block}" for m, s in MODELS.items()) + ")",
    )
    parser.add_argument(
        "--compute-steps",
        type=int,
        help="compute-only steps after each block (default: the block's size)",
    )
    parser.add_argument("--batch", type=int, help="per-rank batch (default: the model's)")
    parser.add_argument(
        "--threads", type=int, help="torch threads per rank (default cores / ranks)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave glibc malloc as it is (default: every rank calls "
        "commopt.reuse_freed_memory(), for every configuration alike)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds one model's job may take (default 3600)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=300,
        help="seconds a rank waits in one collective before the job fails and "
        "restarts without that configuration (default 300)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each configuration's first round, run --profile-steps more "
        "steps as timed and as many under torch.profiler, and report each thread's "
        "time per phase (forward, backward, pack, encode, transport, wait, decode, "
        "agree, unpack, apply) and CPU beside the floor",
    )
    parser.add_argument(
        "--profile-steps", type=int, default=5, help="steps profiled per configuration (default 5)"
    )
    parser.add_argument(
        "--profile-plot",
        metavar="PATH",
        help="with --profile: write a stacked-bar PNG of time per thread and phase",
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure and raw timing as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables as markdown")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of step time per configuration")
    parser.add_argument("--workdir", help="keep each job's log and JSON here")
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        help="run nothing: recompute and write the tables and plot of a report saved with --json",
    )
    parser.add_argument(
        "--sim-measurements",
        metavar="PATH",
        help="write one simulator measurement entry per (model, configuration) for "
        "benchmarks/sim_validation.py --measured (with --from-json or after a run)",
    )
    # Internal: one rank of a job running a schedule of configurations (the driver starts them).
    parser.add_argument("--worker", metavar="SCHEDULE", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or, with --worker, one rank of one job)."""
    if args.worker:
        from commopt.bench.step.worker import run_worker

        return run_worker(args)
    from commopt.bench.step.driver import rerender, run_driver

    if args.from_json:
        rerender(args)
        return 0
    if args.comm == "mpi" and args.launcher != "mpi":
        raise SystemExit("commopt bench step: --comm mpi needs --launcher mpi")
    if args.nprocs < 2:
        raise SystemExit(
            "commopt bench step: -n must be at least 2 (every configuration measures its "
            "own 1-rank compute time)"
        )
    if (
        any(v is not None and v < 1 for v in (args.steps, args.compute_steps, args.block))
        or args.warmup < 0
        or args.rounds < 1
    ):
        raise SystemExit(
            "commopt bench step: need --steps, --block and --compute-steps >= 1, "
            "--warmup >= 0 and --rounds >= 1"
        )
    report = run_driver(args)
    failed = [
        f"{m}/{r['config']}"
        for m, info in report["models"].items()
        for r in info["rows"]
        if r["error"]
    ]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
