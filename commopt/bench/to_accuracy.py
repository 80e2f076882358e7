"""`commopt bench to_accuracy`: wall time to a target validation loss, DDP against commopt.

One job of ``-n`` ranks on the emulated hosts of the step benchmark (``--link``, default
1 Gbit/s; plain loopback, said so, without namespaces) trains a communication-bound task, the
wide character MLP of recipes.text_lm.wide (about 21 M parameters, 84 MB of fp32 gradient per
step) on Python's help topics, once per configuration, one after another. The target is DDP
fp32's validation loss at the end of the budget (it runs first); the report gives each
configuration's wall time and steps to it, its loss at the budget, and the link's limit per step.
Runs from a checkout (the task lives in ``recipes/``).

    $ commopt bench to_accuracy --budget 60 --json benchmarks/results/tta-1gbit.json \\
          --markdown /tmp/tta.md --plot docs/plots/tta-1gbit.png
    $ commopt bench to_accuracy --from-json benchmarks/results/tta-1gbit.json --markdown x.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

#: DDP's four and commopt's qsgd4+EF with overlap and with double buffering, fp32 first.
DEFAULT_CONFIGS = (
    "ddp-fp32,ddp-fp16,ddp-powersgd1,ddp-powersgd4,commopt-fp16,"
    "commopt-qsgd4+ef,commopt-qsgd4+ef-db"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated step-benchmark configurations, ddp-fp32 first "
        f"(default {DEFAULT_CONFIGS})",
    )
    parser.add_argument(
        "-n", "--nprocs", type=int, default=2, help="ranks, one per host (default 2)"
    )
    parser.add_argument("--link", default="1gbit", help="emulated link rate (default 1gbit)")
    parser.add_argument("--no-link", action="store_true", help="plain loopback, unshaped")
    parser.add_argument(
        "--budget",
        type=int,
        default=60,
        help="training steps per configuration "
        "(default 60); the target is DDP fp32's loss after them",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="the target is DDP fp32's loss at the budget x (1 + this) (default "
        "0.01; with --from-json it re-decides a saved run)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=5, help="steps between evaluations (default 5)"
    )
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch (default 64)")
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="Adam's learning rate (default 1e-3)"
    )
    parser.add_argument(
        "--hidden", type=int, default=4096, help="MLP width (default 4096: 21 M parameters)"
    )
    parser.add_argument("--context", type=int, default=16, help="characters seen (default 16)")
    parser.add_argument(
        "--valid-windows", type=int, default=2048, help="validation windows (default 2048)"
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads per rank (default cores / ranks)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds the job may take")
    parser.add_argument("--collective-timeout", type=float, default=300)
    parser.add_argument("--json", metavar="PATH", help="write the curves and the table as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of loss against wall time")
    parser.add_argument("--from-json", metavar="PATH", help="run nothing: re-render a saved report")
    from commopt.bench.to_accuracy_worker import add_worker_arguments

    add_worker_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from commopt.bench import to_accuracy_report as report_mod

    if args.worker:
        from commopt.bench.to_accuracy_worker import run_worker

        return run_worker(args)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        report["rendered_by"] = "commopt " + " ".join(map(shlex.quote, sys.argv[1:]))
        report_mod.write_outputs(report, args)
        return 0
    report = run_driver(args)
    report_mod.write_outputs(report, args)
    return 0 if all("curve" in r for r in report["runs"].values()) else 1


def run_driver(args: argparse.Namespace) -> dict:
    """Launch the job, one configuration after another; the report with every curve."""
    from commopt.bench.step.configs import CONFIGS
    from commopt.bench.step.driver import (
        _machine,
        _threads_per_rank,
        plan_link,
        root_cause,
        start_job,
    )
    from commopt.bench.to_accuracy_worker import PROGRESS
    from commopt.commands.launch import launch_argv

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs or configs[0] != "ddp-fp32":
        raise SystemExit(
            f"commopt bench to_accuracy: --configs must start with ddp-fp32 (the "
            f"target) and name only {', '.join(CONFIGS)}; got {args.configs!r}"
        )
    plan = plan_link(None if args.no_link else args.link)
    threads = args.threads or _threads_per_rank(args.nprocs)
    argv_cmd = sys.argv[1:]
    command = (
        "commopt " + " ".join(map(shlex.quote, argv_cmd))
        if argv_cmd[:2] == ["bench", "to_accuracy"]
        else " ".join(map(shlex.quote, sys.argv))
    )
    report = {
        "command": command,
        "link": plan.description,
        "rate_bits": plan.rate_bits,
        "nprocs": args.nprocs,
        "threads_per_rank": threads,
        "machine": _machine(),
        "load_average_start": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "budget": args.budget,
        "eval_every": args.eval_every,
        "batch_per_rank": args.batch,
        "model": (
            f"wide char MLP (context {args.context}, hidden {args.hidden}), Adam lr "
            f"{args.lr}, batch {args.batch} per rank"
        ),
        "runs": {},
    }
    print(
        f"time to accuracy: {args.nprocs} ranks, {plan.description}; {args.budget} steps per "
        f"configuration",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="commopt-tta-") as tmp:
        result = Path(tmp) / "result.json"
        worker = [
            sys.executable,
            "-m",
            "commopt",
            "bench",
            "to_accuracy",
            "--worker",
            ",".join(configs),
            "--result",
            str(result),
        ]
        for opt in (
            "budget",
            "eval_every",
            "batch",
            "lr",
            "hidden",
            "context",
            "valid_windows",
            "seed",
            "collective_timeout",
        ):
            worker += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
        worker += ["--threads", str(threads)]
        argv = launch_argv(args.nprocs, "--timeout", str(args.timeout))
        if plan.link_arg:
            argv += ["--link", plan.link_arg]
        log = []
        proc = start_job(argv + ["--", *worker], threads)
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            log.append(line)
            if line.startswith(PROGRESS):
                print(line[len(PROGRESS) :].rstrip(), flush=True)
        rc = proc.wait()
        records = json.loads(result.read_text()) if result.exists() else []
    for rec in records:
        report["runs"][rec.pop("config")] = rec
    for name in configs:
        if name not in report["runs"]:
            why = root_cause("".join(log)) if rc else "did not run"
            report["runs"][name] = {"error": f"exit code {rc}: {why}"}
    report["load_average_end"] = os.getloadavg()[0]
    return report
