"""The step benchmark's driver: one job of ``-n`` ranks per model under ``commopt launch``.

The ranks run on an emulated cluster of hosts joined by ``--link`` links (commopt.testbed),
one rank per host, or on plain loopback, said so, where network namespaces are unavailable.
The whole list of configurations runs ``--rounds`` times, configuration after configuration,
so a change in the load of the machine during the run hits every configuration alike. A job
that fails (a configuration that crashes or hangs past ``--collective-timeout``) is restarted
without that configuration.

    >>> plan_link(None).description
    'plain loopback (unshaped: --no-link)'
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from commopt.bench.harness import bench_command_line, machine, threads_per_rank
from commopt.bench.step.configs import CONFIGS, allreduce_limit_s, parse_rate
from commopt.bench.step.figures import check_targets, merge_rounds, summarize
from commopt.bench.step.models import MODELS
from commopt.bench.step.report import print_model, write_outputs
from commopt.bench.step.worker import PROGRESS
from commopt.commands.launch import launch_argv

#: The folder holding the commopt package this runs from: the ranks import the same one.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])


@dataclass
class LinkPlan:
    """Where the ranks run: the link's rate (None: loopback) and how to say so."""

    rate_bits: float | None  # None: unshaped loopback
    link_arg: str | None  # what goes to `commopt launch --link`
    description: str


def plan_link(link: str | None) -> LinkPlan:
    """Emulated hosts joined by ``link`` if namespaces work here, else plain loopback, said so."""
    if link is None:
        return LinkPlan(None, None, "plain loopback (unshaped: --no-link)")
    rate = parse_rate(link)
    from commopt.testbed import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        return LinkPlan(
            None, None, f"plain loopback, unshaped: no emulated {link} link here because {reason}"
        )
    return LinkPlan(
        rate, link, f"emulated hosts joined by {link} links (tc tbf, network namespaces)"
    )


def _job_argv(
    args, plan: LinkPlan, model: str, schedule: list[str], result: Path, threads: int
) -> list[str]:
    worker = [
        sys.executable,
        "-m",
        "commopt.bench.step",
        "--worker",
        ",".join(schedule),
        "--model",
        model,
        "--warmup",
        str(args.warmup),
        "--threads",
        str(threads),
        "--seed",
        str(args.seed),
        "--comm",
        args.comm,
        "--collective-timeout",
        str(args.collective_timeout),
        "--result",
        str(result),
    ]
    if args.steps:
        worker += ["--steps", str(args.steps)]
    if args.batch:
        worker += ["--batch", str(args.batch)]
    if args.compute_steps:
        worker += ["--compute-steps", str(args.compute_steps)]
    if args.system_malloc:
        worker += ["--system-malloc"]
    if args.block:
        worker += ["--block", str(args.block)]
    if getattr(args, "profile", False):
        worker += [
            "--profile",
            "--profile-steps",
            str(args.profile_steps),
        ]
    argv = launch_argv(args.nprocs, "--launcher", args.launcher, "--timeout", str(args.timeout))
    if plan.link_arg:
        argv += ["--link", plan.link_arg]
    return argv + ["--", *worker]


def start_job(argv: list[str], threads: int) -> subprocess.Popen[str]:
    """Start a launch command line, its output and errors read as text lines from ``stdout``.

    Unbuffered, ``threads`` OpenMP threads a rank, and the ranks import the commopt this
    driver runs (a checkout or an installed package).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, errors="replace"
    )


def _run_job(
    args, plan, model, schedule, workdir: Path, attempt: int, threads: int, report_line
) -> tuple[list[dict], int | None, str | None]:
    """Run ``schedule`` in one job: (records of every rank, index that failed, why).

    The index is None with a reason when the job failed before any configuration started
    (the launcher itself, or the ranks' start-up): restarting would not help.
    """
    result = workdir / f"{model}-{attempt}.json"
    log = workdir / f"{model}-{attempt}.log"
    argv = _job_argv(args, plan, model, schedule, result, threads)
    current, started = None, False
    with open(log, "w") as out:
        proc = start_job(argv, threads)
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            out.write(line)
            if line.startswith(PROGRESS):
                word, index, name, *rest = line[len(PROGRESS) :].split()
                current = int(index) if word == "start" else None
                started = True
                if word == "done":
                    report_line(int(index), name, float(rest[0]), float(rest[1]))
        rc = proc.wait()
    records = []
    for r in range(args.nprocs):
        path = Path(f"{result}.rank{r}")
        if path.exists():
            records += json.loads(path.read_text())
    if rc == 0:
        return records, None, None
    why = "timed out" if rc == 124 else f"exit code {rc}"
    why = f"{why} (log {log}):\n{root_cause(log.read_text(errors='replace'))}"
    if not started:
        return records, None, why
    done = {e["index"] for e in records if e["rank"] == 0}
    failed = (
        current
        if current is not None
        else next((i for i in range(len(schedule)) if i not in done), 0)
    )
    return records, failed, why


def root_cause(log: str, lines: int = 10) -> str:
    """The end of the failing rank's traceback in a job's log (else the log's last lines).

    ``commopt launch`` names the rank that failed first; torch prefixes each line of an
    uncaught error with ``[rankN]:``. The other ranks' errors (a peer closed the connection)
    are consequences, not the cause.
    """
    text = log.strip().splitlines()
    first = re.search(r"rank (\d+) ended with", log)
    if first:
        mine = [ln for ln in text if ln.startswith(f"[rank{first.group(1)}]:")]
        if mine:
            return "\n".join(mine[-lines:])
    return "\n".join(text[-lines:])


def run_model(
    args, plan: LinkPlan, model: str, configs: list[str], workdir: Path, threads: int
) -> dict[str, dict]:
    """Every configuration of ``model``, ``args.rounds`` times: config -> merged result."""
    schedule = [c for _ in range(args.rounds) for c in configs]
    records: list[dict] = []
    errors: dict[str, str] = {}
    pending = list(range(len(schedule)))  # indices into ``schedule`` not run yet
    attempt = 0
    total = len(schedule)

    def report_line(local, name, step_s, loss):
        k = pending_at_start[local]
        print(
            f"[{k + 1}/{total}] {model} {name}: {step_s * 1e3:.0f} ms/step, final loss {loss:.4f}",
            flush=True,
        )

    while pending:
        pending_at_start = list(pending)
        got, failed, why = _run_job(
            args,
            plan,
            model,
            [schedule[i] for i in pending],
            workdir,
            attempt,
            threads,
            report_line,
        )
        for e in got:  # the job numbered its own schedule: back to this run's numbering
            e["index"] = pending_at_start[e["index"]]
            e["round"] = e["index"] // len(configs)
        records += got
        if failed is None:
            if why is not None:  # the job could not start: what never ran fails with it
                ran = {e["config"] for e in records}
                for i in pending:
                    if schedule[i] not in ran:
                        errors.setdefault(schedule[i], why)
                print(f"{model}: the job failed before its first configuration: {why}", flush=True)
            break
        bad = schedule[pending_at_start[failed]]
        assert why is not None  # _run_job gives the reason with every failed index
        errors[bad] = why
        print(f"{model} {bad}: FAILED, {why}\n(restarting the job without {bad})", flush=True)
        done = {e["index"] for e in got if e["rank"] == 0}
        pending = [i for i in pending_at_start if i not in done and schedule[i] != bad]
        attempt += 1
    results = {}
    for name in configs:
        mine = [e for e in records if e["config"] == name]
        if name in errors:
            results[name] = {"error": errors[name]}
        elif mine:
            results[name] = merge_rounds(mine)
        else:
            results[name] = {"error": "did not run"}
    return results


def run_driver(args: argparse.Namespace) -> dict:
    """Run every (model, configuration); print and return the report."""
    import torch

    models = _split(args.models, MODELS, "model")
    configs = _split(args.configs, CONFIGS, "configuration")
    try:
        plan = plan_link(None if args.no_link else args.link)
    except ValueError as exc:
        raise SystemExit(f"commopt bench step: {exc}") from None
    threads = args.threads or threads_per_rank(args.nprocs)
    report = {
        "command": _command_line(args),
        "link": plan.description,
        "link_rate": plan.link_arg,
        "rate_bits": plan.rate_bits,
        "nprocs": args.nprocs,
        "threads_per_rank": threads,
        "launcher": args.launcher,
        "commopt_comm": args.comm,
        "machine": machine(),
        "torch": torch.__version__,
        "load_average_start": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "warmup": args.warmup,
        "rounds": args.rounds,
        "models": {},
    }
    print(
        f"step benchmark: {args.nprocs} ranks, {plan.description}; {threads} thread(s) per "
        f"rank; {args.rounds} round(s) of every configuration, {args.warmup} warm-up steps "
        f"each",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="commopt-step-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for model in models:
            spec = MODELS[model]
            results = run_model(args, plan, model, configs, workdir, threads)
            rows = summarize(results, args.nprocs, plan.rate_bits)
            params = next((r["params"] for r in results.values() if "params" in r), None)
            fp32_limit = (
                allreduce_limit_s(4 * params, args.nprocs, plan.rate_bits) if params else None
            )
            report["models"][model] = {
                "description": spec.description,
                "role": spec.role,
                "params": params,
                "batch_per_rank": args.batch or spec.batch_size,
                "steps": args.steps or spec.steps,
                "fp32_allreduce_limit_s": fp32_limit,
                "rows": [vars(r) for r in rows],
                "raw": results,
                "targets": check_targets(spec.role, rows),
            }
            print_model(
                model,
                report["models"][model],
                rows,
                args.nprocs,
                plan,
                targets=not getattr(args, "hide_targets", False),
            )
    report["load_average_end"] = os.getloadavg()[0]
    write_outputs(report, args)
    return report


def rerender(args: argparse.Namespace) -> dict:
    """Recompute the tables of a saved ``--json`` report (``--from-json``) and write them again."""
    report = json.loads(Path(args.from_json).read_text())
    plan = LinkPlan(report["rate_bits"], report.get("link_rate"), report["link"])
    for model, info in report["models"].items():
        rows = summarize(info["raw"], report["nprocs"], report["rate_bits"])
        info["rows"] = [vars(r) for r in rows]
        info["targets"] = check_targets(info["role"], rows)
        info.setdefault("steps", MODELS[model].steps)
        print_model(model, info, rows, report["nprocs"], plan)
    report.setdefault(
        "rounds",
        max(
            len(r.get("rounds", []))
            for info in report["models"].values()
            for r in info["raw"].values()
        ),
    )
    write_outputs(report, args)
    return report


def _command_line(args) -> str:
    """How this run was started, for the record."""
    if getattr(args, "command_line", None):  # set by a caller such as `commopt demo`
        return args.command_line
    return bench_command_line("step")


def _split(text: str, valid: dict, what: str) -> list[str]:
    """The names in comma-separated ``text``, each one of ``valid``'s, none twice."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in valid]
    if bad or not names:
        raise SystemExit(
            f"commopt bench step: unknown {what} {', '.join(bad) or '(none given)'}; "
            f"choose from {', '.join(valid)}"
        )
    if len(set(names)) != len(names):
        raise SystemExit(f"commopt bench step: a {what} is named twice in {text!r}")
    return names
