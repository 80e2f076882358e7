"""`commopt demo`: what a new user should see first.

Two hosts joined by an emulated 1 Gbit/s link train the same communication-bound model
(a wide MLP of 25M parameters, batch 8 per host) with PyTorch DDP in fp32 and with commopt
(fp16, 4-bit QSGD, double buffering), one after the other; then a table (step time,
speed-up over DDP, scaling efficiency, final loss) and a plot. Without root or network
namespaces the hosts are two processes on plain loopback, and the demo says so.

    $ commopt demo                       # about five minutes on a 2-core machine
    $ commopt demo --steps 10            # shorter
    $ commopt demo --tour                # the allreduce tour: every communicator, timed

The emulated link needs root and network namespaces (commopt.testbed); without them the demo
runs on loopback and says so. The work is done by the step benchmark (commopt.bench.step;
`commopt bench step` runs all of it); the demo picks its configurations and explains the result.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HELP = "run the main demonstration job: DDP vs commopt, 2 hosts on a 1 Gbit/s link"
DESCRIPTION = (
    "DDP against commopt: two hosts joined by an emulated 1 Gbit/s link train the same wide MLP "
    "(25M parameters) with PyTorch DDP in fp32 and with commopt (fp16, 4-bit QSGD, double "
    "buffering), then a table and a plot. The emulated link needs root and network namespaces "
    "(run as root, e.g. sudo, or in a container with CAP_NET_ADMIN); without them the hosts are "
    "two processes on plain loopback, said so. Takes about 5 minutes with the default 30 steps on "
    "a 2-core machine; the time grows with --steps."
)
#: Below this many steps per configuration the demo does not compare final losses: a few steps
#: from the same start leave every configuration near the initial loss, and double buffering's
#: one-step delay alone separates them (noise, not a statement about the codecs).
LOSS_COMPARISON_MIN_STEPS = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument(
        "--steps",
        type=int,
        default=30,
        help="training steps per configuration, 3 of them warm-up (default 30)",
    )
    parser.add_argument(
        "--link", default="1gbit", help="emulated link rate between the 2 hosts (default 1gbit)"
    )
    parser.add_argument(
        "--out",
        default="build/commopt-demo",
        metavar="DIR",
        help="where the plot, table and JSON go (default build/commopt-demo)",
    )
    parser.add_argument(
        "--tour",
        action="store_true",
        help="run the allreduce tour instead: one allreduce through every "
        "communicator available here, timed",
    )
    parser.add_argument("--mib", type=float, default=16, help="(--tour) buffer size in MiB")
    parser.add_argument("-n", "--nprocs", type=int, default=2, help="(--tour) ranks")


def run(args: argparse.Namespace) -> int:
    if args.tour:
        return _tour(args)
    return _main_job(args)


def _tour(args) -> int:
    from commopt.commands.launch import launch_argv

    cmd = [
        *launch_argv(args.nprocs, "--"),
        sys.executable,
        "-m",
        "commopt.examples.allreduce_tour",
        "--mib",
        str(args.mib),
    ]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def _main_job(args) -> int:
    if args.steps < 4:
        print("commopt demo: --steps must be at least 4 (3 are warm-up)", file=sys.stderr)
        return 2
    from commopt.bench import step as bench

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    same = [
        "--models",
        "mlp",
        "--configs",
        ",".join(bench.DEMO_CONFIGS),
        "--link",
        args.link,
        "--rounds",
        "1",
        "--warmup",
        "3",
        "--steps",
        str(args.steps - 3),
        "--block",
        "9",
        "--compute-steps",
        "3",
    ]
    bargs = parser.parse_args(
        same
        + [
            "--timeout",
            "900",
            "--plot",
            str(out / "step_times.png"),
            "--json",
            str(out / "results.json"),
            "--markdown",
            str(out / "results.md"),
        ]
    )
    bargs.hide_targets = True  # the benchmark targets belong to `commopt bench step`
    bargs.command_line = (
        f"commopt demo --steps {args.steps} --link {args.link} "
        f"(the same as: commopt bench step {' '.join(same)})"
    )
    print(_INTRO.format(steps=args.steps, link=args.link), flush=True)
    report = bench.run_driver(bargs)
    info = report["models"]["mlp"]
    rows = {r["config"]: r for r in info["rows"]}
    print(_summary(rows, info, report, steps=args.steps))
    failed = [name for name, r in rows.items() if r["error"]]
    return 1 if failed else 0


_INTRO = """\
commopt demo: 2 hosts train a wide MLP (25.2M parameters, batch 8 per host) for {steps} steps
with each configuration in turn, every host joined to the other by a {link} link:

  ddp-fp32             PyTorch DistributedDataParallel, fp32 gradients over gloo
  commopt-fp16         commopt, gradients in fp16, sent during backward (overlap)
  commopt-qsgd4        commopt, 4-bit QSGD (bucket 128), sent during backward
  commopt-fp16-db      commopt fp16 with double buffering: step t's reduction runs during step t+1
  commopt-qsgd4+ef-db  commopt 4-bit QSGD with error feedback and double buffering

Every configuration starts from the same weights and sees the same batches. Beside each,
every host also trains a copy of the model without communication: the compute-only time
of one host at that moment. Columns: step time (median), compute-only time, the link's
limit for that configuration's gradient allreduce, samples/s, speed-up over DDP fp32,
scaling efficiency (one host's compute time / step time), the share of a step spent
beyond compute (waiting for the network, sending), and the loss on a held-out batch after
the last step.
"""


def _summary(rows: dict, info: dict, report: dict, steps: int = 30) -> str:
    lines = []
    ddp = rows.get("ddp-fp32")
    ok = [r for r in rows.values() if r["kind"] == "commopt" and r["step_s"] is not None]
    if ddp and ddp["step_s"] is not None and ok:
        best = min(ok, key=lambda r: r["step_s"])
        short = (
            f"In short: {best['config']} takes {best['step_s'] * 1e3:.0f} ms per step "
            f"against DDP fp32's {ddp['step_s'] * 1e3:.0f} ms ({best['speedup']:.1f}x)"
        )
        losses = steps >= LOSS_COMPARISON_MIN_STEPS
        if losses and best["final_loss"] is not None and ddp["final_loss"] is not None:
            short += f", final loss {best['final_loss']:.4f} against {ddp['final_loss']:.4f}"
        lines.append(short + ".")
        if not losses:
            lines.append(
                f"The final losses are not compared: {steps} steps from scratch are too "
                f"few for them to say anything about the codecs (run --steps "
                f"{LOSS_COMPARISON_MIN_STEPS} or more)."
            )
        db = [r for r in ok if r["config"].endswith("-db") and r["final_loss"] is not None]
        if losses and db and db[0]["final_loss"] > 1.01 * ddp["final_loss"]:
            lines.append(
                f"Double buffering applies each step's gradients one step late: in "
                f"these first few steps from scratch that costs some progress "
                f"(loss {db[0]['final_loss']:.4f}); over a whole training the recipes "
                f"find it within 1 point of fp32's accuracy at a suitable learning rate "
                f"(docs/recipes.md)."
            )
        if info.get("fp32_allreduce_limit_s"):
            lines.append(
                f"DDP fp32 cannot beat the link: its {info['params'] * 4 / 1e6:.0f} MB "
                f"gradient needs {info['fp32_allreduce_limit_s'] * 1e3:.0f} ms per "
                f"step on a {report['link_rate']} link, whatever the software does."
            )
    if report.get("rate_bits") is None:
        lines.append(
            f"Note: {report['link']}. Loopback is far faster than a real network, so "
            f"the speed-ups here understate what a slow link shows."
        )
    else:
        lines.append(
            "Note: the emulated hosts share this machine's cores, so the CPU work of "
            "sending (copies, encoding) competes with compute, as it would not on "
            "separate hosts."
        )
    load, cores = report.get("load_average_start", 0.0), os.cpu_count() or 1
    if load > cores:
        lines.append(
            f"Note: this machine was busy (load average {load:.1f} on {cores} cores): "
            f"compute and sending ran slower than on an idle machine."
        )
    lines.append(
        "More: `commopt bench step` runs every configuration (DDP fp16 and PowerSGD too) "
        "on this model and on a compute-bound CNN; docs/benchmarks-step.md has the results."
    )
    return "\n".join(lines)
