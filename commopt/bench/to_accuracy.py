"""`commopt bench to_accuracy`: wall time to a target validation loss, DDP against commopt.

One job of ``-n`` ranks on the emulated hosts of the step benchmark (``--link``, default
1 Gbit/s; plain loopback, said so, without namespaces) trains a communication-bound real task
(``--task``: ``text``, the wide character MLP on Python's help topics, or ``digits``, a wide
MLP on scikit-learn's digits; see ``commopt.bench.to_accuracy_tasks``) once per configuration
and seed (``--seeds``), one after another. For each seed DDP fp32 runs first, ``--budget``
steps; its validation loss there, raised by ``--tolerance``, is the target. Every other
configuration gets up to ``--budget-factor`` x the budget and stops at the first evaluation at
or below the target. The report gives, per configuration, the mean and spread over the seeds
of the wall time and steps to the target, the speed-up against DDP fp32 and against the best
DDP hook that reaches it, the floor (steps to the target x that configuration's compute-plus-
codec time per step, measured in the same run) and the ratio to it, and the link's limit per
step. Runs from a checkout (the tasks' data live in ``recipes/``).

Two settings (``--setting``): ``compute-heavy`` (the default: batch 64 per rank, hidden
4096, 1 Gbit/s; DDP fp32's step is about 2.5x its compute on 2 shared cores) and
``link-bound`` (batch 16, hidden 2048, 100 Mbit/s, the peers at their best: DDP fp32's step
at least 8x its compute-only step, as on a GPU cluster whose link is the limit). Every run
measures that ratio, prints it in its header, records it (``setting_check``) and warns
loudly where the link-bound setting falls below 8x.

    $ commopt bench to_accuracy --setting link-bound --task text --seeds 0 \\
          --json benchmarks/results/tta-text-linkbound-seed0.json
    $ commopt bench to_accuracy --charts docs/plots \\
          --from-json benchmarks/results/tta-text-linkbound-seed0.json
    $ commopt bench to_accuracy --task text --seeds 0,1,2 \\
          --json benchmarks/results/tta-text-1gbit.json --markdown /tmp/tta-text.md \\
          --plot docs/plots/tta-text-1gbit.png
    $ commopt bench to_accuracy --from-json benchmarks/results/tta-text-1gbit.json --markdown x.md
    $ commopt bench to_accuracy --from-json benchmarks/results/tta-text-1gbit.json \\
          --from-json benchmarks/results/tta-digits-1gbit.json --write-multipliers

Runs of one task made by several commands (say, every configuration on seed 0 and the
headline's configurations on more seeds) are reported together by giving ``--from-json``
once per file (``PATH#CONFIG,CONFIG``: only those configurations' runs of that file); each
configuration is then compared with DDP fp32 and with the DDP hooks on the seeds both ran.
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

#: DDP's fp32, fp16 and PowerSGD (rank 1 and 4, from step 2 and after the documented warm-up);
#: commopt's fp16, qsgd4+EF, PowerSGD rank 1 and 4, with overlap, double buffering and
#: compensated double buffering, and auto; fp32 first.
DEFAULT_CONFIGS = (
    "ddp-fp32,ddp-fp16,ddp-powersgd1,ddp-powersgd4,ddp-powersgd1-warm,ddp-powersgd4-warm,"
    "commopt-fp16,commopt-fp16-comp,commopt-qsgd4+ef,commopt-qsgd4+ef-db,"
    "commopt-qsgd4+ef-comp,commopt-powersgd1,commopt-powersgd4,commopt-powersgd4-db,"
    "commopt-powersgd4-comp,commopt-auto,commopt-auto-db,commopt-auto-comp"
)
#: The link-bound setting's configurations: every peer at its documented best (DDP's fp16 and
#: bf16 hooks; PowerSGD rank 1 and 4 after torch's suggested warm-up) and commopt's best
#: configurations, fp32 first. Configurations added by other settings go in their own tuple.
LINK_BOUND_CONFIGS = (
    "ddp-fp32,ddp-fp16,ddp-bf16,ddp-powersgd1-warm,ddp-powersgd4-warm,"
    "commopt-qsgd4+ef,commopt-qsgd4+ef-db,commopt-powersgd4,commopt-auto,commopt-auto-stream16,"
    "commopt-auto-stream16-overlap7,commopt-local-steps32-qsgd4+ef,"
    "commopt-local-steps16-stream-qsgd4+ef,commopt-local-steps16-stream-overlap7-qsgd4+ef,"
    "torchft-diloco16"
)
#: ``--setting``: the per-rank batch, the MLP width and the emulated link of each setting
#: (docs/benchmarks-accuracy.md works the choice out against GPU clusters). ``compute-heavy``
#: is the historical one: on 2 shared cores DDP fp32 spends about 40% of its step computing.
#: ``link-bound``: a narrower model, a small batch and a slow link, so that DDP fp32's step
#: is at least LINK_BOUND_MIN_RATIO x its compute-only step, as on a GPU cluster whose link is
#: the limit; measured in every run and checked by ``to_accuracy_report.setting_check``.
SETTINGS: dict[str, dict] = {
    "compute-heavy": {
        "batch": 64,
        "hidden": 4096,
        "link": "1gbit",
        "configs": None,
        "outer_lr": None,
    },
    "link-bound": {
        "batch": 16,
        "hidden": 2048,
        "link": "100mbit",
        "configs": LINK_BOUND_CONFIGS,
        # 2 ranks at batch 16: half DiLoCo's 0.7 (tuned for 8 workers); chosen on text seed 0
        # from 0.35 / 0.5 / 0.7 (docs/local-steps.md), torchft's DiLoCo given the same
        "outer_lr": 0.35,
    },
}
DEFAULT_SETTING = "compute-heavy"
#: Training steps of DDP fp32, whose loss there is the target (others: up to
#: DEFAULT_BUDGET_FACTOR x as many).
DEFAULT_BUDGET = 150
#: On the text task PowerSGD rank 1, even after its warm-up, needs about 3x fp32's steps
#: (docs/benchmarks-accuracy.md): the peers get that many before they count as not reaching it.
DEFAULT_BUDGET_FACTOR = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from commopt.bench.step.configs import POWERSGD_WARMUP_FRACTION
    from commopt.bench.to_accuracy_tasks import TASKS

    parser.add_argument(
        "--setting",
        choices=sorted(SETTINGS),
        default=DEFAULT_SETTING,
        help="compute-heavy: batch 64, hidden 4096, 1gbit (DDP fp32 ~2.5x its compute); "
        "link-bound: batch 16, hidden 2048, 100mbit and the peers at their best (DDP fp32's "
        "step >= 8x its compute-only step, measured and checked in every run); "
        "--batch, --hidden, --link and --configs override it (default compute-heavy)",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated step-benchmark configurations, ddp-fp32 first (default: the "
        f"setting's; compute-heavy: {DEFAULT_CONFIGS}; link-bound: {LINK_BOUND_CONFIGS})",
    )
    parser.add_argument(
        "--task",
        choices=sorted(TASKS),
        default="text",
        help="text: wide char MLP on Python's help topics; digits: wide MLP on "
        "scikit-learn's digits (default text)",
    )
    parser.add_argument(
        "--seeds",
        default="0,1,2",
        help="comma-separated seeds; every configuration runs once per seed (default 0,1,2)",
    )
    parser.add_argument(
        "-n", "--nprocs", type=int, default=2, help="ranks, one per host (default 2)"
    )
    parser.add_argument(
        "--link", default=None, help="emulated link rate (default: the setting's, 1gbit or 100mbit)"
    )
    parser.add_argument("--no-link", action="store_true", help="plain loopback, unshaped")
    parser.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_BUDGET,
        help=f"DDP fp32's training steps (default {DEFAULT_BUDGET}); the target is its loss "
        "after them",
    )
    parser.add_argument(
        "--budget-factor",
        type=float,
        default=DEFAULT_BUDGET_FACTOR,
        help="the other configurations train up to this x the budget, stopping at the "
        f"target (default {DEFAULT_BUDGET_FACTOR:g})",
    )
    parser.add_argument(
        "--powersgd-warmup",
        type=float,
        default=POWERSGD_WARMUP_FRACTION,
        help="the -warm PowerSGD configurations' plain-allreduce warm-up, a fraction of the "
        f"budget (default {POWERSGD_WARMUP_FRACTION:g}, as torch's PowerSGDState suggests; "
        "at least 2 steps)",
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
    parser.add_argument(
        "--batch", type=int, default=None, help="per-rank batch (default: the setting's, 64 or 16)"
    )
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="Adam's learning rate (default 1e-3)"
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="MLP width (default: the setting's; 4096: 21.4M parameters on text, 17.1M on "
        "digits; 2048: 6.6M on text, 4.3M on digits)",
    )
    parser.add_argument(
        "--context", type=int, default=16, help="text: characters seen (default 16)"
    )
    parser.add_argument(
        "--valid-windows", type=int, default=2048, help="text: validation windows (default 2048)"
    )
    parser.add_argument(
        "--outer-lr",
        type=float,
        help="the local-steps configurations' and torchft's DiLoCo's outer learning rate "
        "(default: the setting's; link-bound 0.35, compute-heavy the schedule's, 0.7)",
    )
    parser.add_argument(
        "--compute-steps",
        type=int,
        default=15,
        help="compute-only steps timed after each configuration, for the floor: the median "
        "of 3 repeats of a third of them each (default 15)",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads per rank (default cores / ranks)"
    )
    parser.add_argument("--timeout", type=float, default=14400, help="seconds the job may take")
    parser.add_argument("--collective-timeout", type=float, default=300)
    parser.add_argument("--json", metavar="PATH", help="write the curves and the table as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of loss against wall time")
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        action="append",
        help="run nothing: re-render a saved report; given more than once, the reports' runs "
        "are merged (each configuration and seed in one of them only); PATH#CONFIG,CONFIG "
        "takes only those configurations' runs from PATH",
    )
    parser.add_argument(
        "--charts",
        metavar="DIR",
        help="with --from-json: run nothing, write a loss-against-wall-time chart per task and "
        "setting (tta-TASK-SETTING.png) and the speed-up chart of every configuration "
        "(tta-speedup.png) into DIR (needs matplotlib)",
    )
    parser.add_argument(
        "--write-multipliers",
        metavar="PATH",
        nargs="?",
        const="",
        help="with --from-json: run nothing, rewrite compression='auto''s step multipliers "
        "(steps to the target relative to DDP fp32) from the given result files, at PATH "
        "(default: the package's commopt/optim/step_multipliers.json)",
    )
    from commopt.bench.to_accuracy_worker import add_worker_arguments

    add_worker_arguments(parser)


def apply_setting(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``--batch``, ``--hidden``, ``--link``, ``--outer-lr`` and ``--configs`` left unset
    from ``--setting``'s values (in place; returns ``args``)."""
    setting = SETTINGS[getattr(args, "setting", None) or DEFAULT_SETTING]
    for key in ("batch", "hidden", "link", "outer_lr"):
        if getattr(args, key, None) is None:
            setattr(args, key, setting[key])
    if getattr(args, "configs", None) is None:
        args.configs = setting["configs"] or DEFAULT_CONFIGS
    return args


def run(args: argparse.Namespace) -> int:
    from commopt.bench import to_accuracy_report as report_mod

    apply_setting(args)

    if args.worker:
        from commopt.bench.to_accuracy_worker import run_worker

        return run_worker(args)
    if getattr(args, "write_multipliers", None) is not None:
        if not args.from_json:
            raise SystemExit(
                "commopt bench to_accuracy: --write-multipliers reads result files: give them "
                "with --from-json PATH (once per file)"
            )
        from commopt.bench.to_accuracy_multipliers import write_multipliers
        from commopt.optim.step_multipliers import TABLE_PATH

        out = args.write_multipliers or TABLE_PATH
        table = write_multipliers(args.from_json, out)
        for section in ("codecs", "schedules"):
            for name, entry in sorted(table[section].items()):
                print(
                    f"{section[:-1]} {name}: x{entry['multiplier']:g} ({entry.get('source', '')})"
                )
        print(f"wrote {out}", flush=True)
        return 0
    if getattr(args, "charts", None):
        if not args.from_json:
            raise SystemExit(
                "commopt bench to_accuracy: --charts draws result files: give them with "
                "--from-json PATH (once per file)"
            )
        from commopt.bench.to_accuracy_charts import write_charts

        for path in write_charts(args.from_json, args.charts):
            print(f"wrote {path}", flush=True)
        return 0
    if args.from_json:
        report = report_mod.merge_reports([report_mod.read_report(p) for p in args.from_json])
        report["rendered_by"] = "commopt " + " ".join(map(shlex.quote, sys.argv[1:]))
        report_mod.write_outputs(report, args)
        return 0
    report = run_driver(args)
    report_mod.write_outputs(report, args)
    # A configuration that could not be built (its error is in the table) does not fail the
    # run; a job that ended early does.
    failed = [
        rec
        for run in report["runs"].values()
        for rec in run["seeds"].values()
        if str(rec.get("error", "")).startswith("exit code")
    ]
    return 1 if failed else 0


def run_driver(args: argparse.Namespace) -> dict:
    """Launch the job, one configuration after another; the report with every curve."""
    from commopt.bench.harness import machine, threads_per_rank
    from commopt.bench.step.configs import CONFIGS
    from commopt.bench.step.driver import (
        plan_link,
        root_cause,
        start_job,
    )
    from commopt.bench.to_accuracy_report import SETTING_MIN_RATIO
    from commopt.bench.to_accuracy_tasks import TASKS
    from commopt.bench.to_accuracy_worker import PROGRESS
    from commopt.commands.launch import launch_argv

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs or configs[0] != "ddp-fp32" or len(set(configs)) != len(configs):
        raise SystemExit(
            f"commopt bench to_accuracy: --configs must start with ddp-fp32 (the "
            f"target), name each once and name only {', '.join(CONFIGS)}; got {args.configs!r}"
        )
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(
            f"commopt bench to_accuracy: --seeds is a comma-separated list of distinct "
            f"integers such as 0,1,2; got {args.seeds!r}"
        )
    if args.budget < 1 or args.budget_factor < 1 or not 0 <= args.powersgd_warmup < 1:
        raise SystemExit(
            "commopt bench to_accuracy: needs --budget >= 1, --budget-factor >= 1 and "
            "0 <= --powersgd-warmup < 1"
        )
    plan = plan_link(None if args.no_link else args.link)
    threads = args.threads or threads_per_rank(args.nprocs)
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
        "machine": machine(),
        "load_average_start": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "task": args.task,
        "setting": args.setting,
        "setting_min_ratio": SETTING_MIN_RATIO.get(args.setting),
        "seeds": seeds,
        "budget": args.budget,
        "budget_factor": args.budget_factor,
        "outer_lr": args.outer_lr,
        "powersgd_warmup": args.powersgd_warmup,
        "tolerance": args.tolerance,
        "eval_every": args.eval_every,
        "batch_per_rank": args.batch,
        "model": (
            f"{TASKS[args.task].describe(args)}, Adam lr {args.lr}, batch {args.batch} per rank"
        ),
        "runs": {},
    }
    print(
        f"time to accuracy ({args.task}, {args.setting} setting: batch {args.batch} per rank, "
        f"hidden {args.hidden}): {args.nprocs} ranks, {plan.description}; seeds "
        f"{args.seeds}; DDP fp32 {args.budget} steps, the others up to "
        f"{args.budget_factor:g}x as many",
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
            "setting",
            "task",
            "seeds",
            "budget",
            "budget_factor",
            "powersgd_warmup",
            "tolerance",
            "compute_steps",
            "eval_every",
            "batch",
            "lr",
            "hidden",
            "context",
            "valid_windows",
            "outer_lr",
            "collective_timeout",
        ):
            if getattr(args, opt) is None:
                continue
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
        name, seed = rec.pop("config"), rec.pop("seed")
        report["runs"].setdefault(name, {"seeds": {}})["seeds"][str(seed)] = rec
    why = root_cause("".join(log)) if rc else "did not run"
    for name in configs:
        run = report["runs"].setdefault(name, {"seeds": {}})
        for seed in seeds:
            run["seeds"].setdefault(str(seed), {"error": f"exit code {rc}: {why}"})
    report["load_average_end"] = os.getloadavg()[0]
    return report
