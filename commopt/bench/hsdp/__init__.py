"""``commopt bench hsdp``: FSDP2's HSDP against HSDP with commopt's reduction between nodes.

    $ commopt bench hsdp                                  # 2 emulated hosts x 2 ranks, 1 Gbit/s
    $ commopt bench hsdp --configs hsdp-fp32,commopt-qsgd4-ef --rounds 5 --json hsdp.json
    $ commopt bench hsdp --accuracy --no-link --seeds 0,1,2   # the digits task, validation loss

One job of ``--nodes`` x ``--ranks-per-node`` ranks under ``commopt launch --launcher torch``,
on emulated hosts joined by ``--link`` links (commopt.testbed), or on plain loopback, said
so, where network namespaces are unavailable. Every configuration runs in the same job,
round after round, so a change in the machine's load hits them alike (see
:mod:`commopt.bench.hsdp.worker` for the configurations). The table gives each one's step
time beside its physical limits: the link floor (the bytes each host must send between nodes
per step at the link's rate) and the node-only step (``fsdp-node``: the same training with no
reduction between nodes), and the floor, the larger of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path

DESCRIPTION = "FSDP2's HSDP against HSDP with commopt's reduction between nodes"
DEFAULT_CONFIGS = "fsdp-node,hsdp-fp32,hsdp-bf16,commopt-fp32,commopt-qsgd4-ef"
ACCURACY_CONFIGS = "hsdp-fp32,commopt-qsgd4-ef"
REFERENCE = "hsdp-fp32"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configs",
        help=f"comma-separated configurations (default {DEFAULT_CONFIGS}; with --accuracy "
        f"{ACCURACY_CONFIGS}); commopt-<codec> takes any codec, e.g. commopt-bf16, commopt-qsgd8",
    )
    parser.add_argument("--nodes", type=int, default=2, help="hosts (default 2)")
    parser.add_argument(
        "--ranks-per-node", type=int, default=2, help="ranks per host, FSDP's shards (default 2)"
    )
    parser.add_argument("--link", default="1gbit", help="emulated link rate (default 1gbit)")
    parser.add_argument("--no-link", action="store_true", help="plain loopback, unshaped")
    parser.add_argument(
        "--model",
        default="mlp",
        help="speed: a model of `commopt bench step` (default mlp: 25.2M parameters, "
        "communication-bound)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=4096,
        help="--accuracy: the digits MLP's width (default 4096: 17.1M parameters)",
    )
    parser.add_argument(
        "--batch", type=int, help="per-rank batch (default: the model's; --accuracy 64)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--accuracy",
        action="store_true",
        help="train the digits task of `commopt bench to_accuracy` instead of timing steps",
    )
    parser.add_argument(
        "--task",
        choices=("digits", "text"),
        default="digits",
        help="--accuracy: a task of `commopt bench to_accuracy` (default digits)",
    )
    parser.add_argument(
        "--context", type=int, default=16, help="--accuracy, text: characters seen (default 16)"
    )
    parser.add_argument(
        "--valid-windows", type=int, default=2048, help="--accuracy, text: validation windows"
    )
    parser.add_argument(
        "--budget", type=int, default=150, help="--accuracy: Adam steps (default 150)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="--accuracy: Adam's rate")
    parser.add_argument("--seeds", default="0", help="--accuracy: comma-separated seeds")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default cores/ranks)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds the job may take")
    parser.add_argument("--collective-timeout", type=float, default=300)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    parser.add_argument(
        "--from-json", metavar="PATH", help="run nothing: print the table of a saved report"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from commopt.bench.hsdp.worker import check_configs, run_worker

    if args.configs is None:
        args.configs = ACCURACY_CONFIGS if args.accuracy else DEFAULT_CONFIGS
    if args.batch is None and args.accuracy:
        args.batch = 64
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // (args.nodes * args.ranks_per_node))
    if args.worker:
        return run_worker(args)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
    else:
        check_configs(args.configs.split(","))
        from commopt.bench.step.models import MODELS

        if args.model not in MODELS:
            raise SystemExit(f"commopt bench hsdp: --model is one of {', '.join(MODELS)}")
        if args.nodes < 2 or args.ranks_per_node < 1:
            raise SystemExit("commopt bench hsdp: needs --nodes >= 2 and --ranks-per-node >= 1")
        report = _run_job(args)
        if report is None:
            return 1
    text = render(report)
    print(text)
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(render(report, markdown=True) + "\n")
    return 0


def _run_job(args: argparse.Namespace) -> dict | None:
    from commopt.bench.step.driver import plan_link, start_job
    from commopt.commands.launch import launch_argv

    plan = plan_link(None if args.no_link else args.link)
    nprocs = args.nodes * args.ranks_per_node
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="commopt-hsdp-") as tmp:
        result = Path(tmp) / "result.json"
        worker = [
            sys.executable, "-m", "commopt.bench.hsdp", "--worker", "--result", str(result),
            "--configs", args.configs, "--nodes", str(args.nodes),
            "--ranks-per-node", str(args.ranks_per_node), "--model", args.model,
            "--hidden", str(args.hidden),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--rounds", str(args.rounds), "--seed", str(args.seed), "--budget", str(args.budget),
            "--lr", str(args.lr), "--seeds", args.seeds, "--threads", str(args.threads),
            "--collective-timeout", str(args.collective_timeout),
        ]  # fmt: skip
        if args.accuracy:
            worker += ["--accuracy", "--task", args.task, "--context", str(args.context)]
            worker += ["--valid-windows", str(args.valid_windows)]
        if args.batch:
            worker += ["--batch", str(args.batch)]
        argv = launch_argv(
            nprocs, "--launcher", "torch", "--ranks-per-host", str(args.ranks_per_node),
            "--timeout", str(args.timeout),
        )  # fmt: skip
        if plan.link_arg:
            argv += ["--link", plan.link_arg]
        print(f"commopt bench hsdp: {nprocs} ranks, {plan.description}", flush=True)
        proc = start_job(argv + ["--", *worker], args.threads)
        assert proc.stdout is not None
        tail: list[str] = []
        try:
            for line in proc.stdout:
                if line.startswith("@hsdp "):
                    print(line[len("@hsdp ") :], end="", flush=True)
                tail = (tail + [line])[-30:]
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: `commopt launch` stops the job on SIGINT
                proc.send_signal(signal.SIGINT)
                proc.wait()
        if rc != 0 or not result.exists():
            print(f"commopt bench hsdp: the job failed (exit code {rc}):", file=sys.stderr)
            print("".join(tail), file=sys.stderr)
            return None
        report = json.loads(result.read_text())
    report.update(
        command="commopt bench hsdp " + " ".join(shlex.quote(a) for a in sys.argv[3:])
        if sys.argv[1:3] == ["bench", "hsdp"]
        else " ".join(shlex.quote(a) for a in sys.argv),
        link=plan.description,
        rate_bits=plan.rate_bits,
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        cores=os.cpu_count(),
        load_average=[round(load_start, 2), round(os.getloadavg()[0], 2)],
        steps=args.steps,
        rounds=args.rounds,
        budget=args.budget if args.accuracy else None,
    )
    return report


def render(report: dict, *, markdown: bool = False) -> str:
    """The report's table (terminal text or markdown), with what it ran on."""
    from commopt.tables import table

    if report["mode"] == "accuracy":
        return _render_accuracy(report, markdown)
    from commopt.bench.hsdp.worker import link_floor_s

    configs = report["configs"]
    rate = report.get("rate_bits")
    node_only = configs.get("fsdp-node", {}).get("step_s")
    ref = configs.get(REFERENCE, {}).get("step_s")
    rows = []
    for name, c in configs.items():
        link = link_floor_s(
            c["wire_bytes_per_rank"], report["ranks_per_node"], report["nodes"], rate
        )
        floor = max(
            x for x in (link, node_only if name != "fsdp-node" else None, 0.0) if x is not None
        )
        rows.append([
            name,
            f"{c['step_s'] * 1e3:.0f} (" + ", ".join(f"{s * 1e3:.0f}" for s in c["rounds_s"]) + ")",
            "-" if "rank_cpu_s" not in c else f"{c['rank_cpu_s'] * 1e3:.0f}",
            f"{c['wire_bytes_per_rank'] * report['ranks_per_node'] / 2**20:.1f}",
            "-" if link is None else f"{link * 1e3:.0f}",
            "-" if node_only is None or name == "fsdp-node" else f"{node_only * 1e3:.0f}",
            "-" if not floor else f"{floor * 1e3:.0f}",
            "-" if not floor else f"{c['step_s'] / floor:.2f}",
            "-" if ref is None else f"{ref / c['step_s']:.2f}x",
            f"{c['final_loss']:.4f}",
        ])  # fmt: skip
    headers = [
        "configuration", "step ms (rounds)", "rank CPU ms", "MiB/host/step", "link floor ms",
        "node-only ms", "floor ms", "step/floor", f"vs {REFERENCE}", "final loss",
    ]  # fmt: skip
    head = (
        f"{report['model']}, batch {report['batch']} "
        f"per rank, {report['nodes']} hosts x {report['ranks_per_node']} ranks, "
        f"{report['link']}; median of {report['rounds']} rounds of {report['steps']} steps; "
        f"the hosts share this machine's {report['cores']} cores"
        + (
            f" (load average {report['load_average'][0]:g} at the start, "
            f"{report['load_average'][1]:g} at the end)"
            if report.get("load_average")
            else ""
        )
    )
    return head + "\n\n" + table(headers, rows, markdown=markdown)


def _render_accuracy(report: dict, markdown: bool) -> str:
    from commopt.tables import table

    configs = report["configs"]
    ref = {e["seed"]: e for e in configs.get(REFERENCE, [])}
    rows = []

    def row(name, seed, loss, gap, top1, points, equal, skipped):
        rows.append([
            name, seed, f"{loss:.4f}", "-" if gap is None else f"{gap:+.2f}%",
            "-" if top1 is None else f"{top1:.2f}", "-" if points is None else f"{points:+.2f}",
            equal, skipped,
        ])  # fmt: skip

    for name, entries in configs.items():
        gaps, points = [], []
        for e in entries:
            r = ref.get(e["seed"])
            gap = None if r is None else (e["valid_loss"] / r["valid_loss"] - 1) * 100
            pts = None if r is None or "top1" not in e else e["top1"] - r["top1"]
            gaps += [] if gap is None else [gap]
            points += [] if pts is None else [pts]
            row(name, str(e["seed"]), e["valid_loss"], gap, e.get("top1"), pts,
                "yes" if e["replicas_equal"] else "NO", str(e["skipped_steps"]))  # fmt: skip
        if len(entries) > 1:
            mean = sum(e["valid_loss"] for e in entries) / len(entries)
            tops = [e["top1"] for e in entries if "top1" in e]
            row(f"{name} (mean)", "all", mean, sum(gaps) / len(gaps) if gaps else None,
                sum(tops) / len(tops) if tops else None,
                sum(points) / len(points) if points else None, "", "")  # fmt: skip
    head = (
        f"{report['task']}: {report['budget']} Adam steps (lr {report.get('lr', '-')}) per "
        f"configuration, batch {report['batch']} per rank, {report['nodes']} hosts x "
        f"{report['ranks_per_node']} ranks ({report['link']}); gaps paired by seed"
    )
    headers = [
        "configuration", "seed", "validation loss", f"vs {REFERENCE}", "top-1 %",
        "points", "replicas equal", "skipped",
    ]  # fmt: skip
    return head + "\n\n" + table(headers, rows, markdown=markdown)
