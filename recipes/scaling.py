"""Scaling runs: a recipe at 1, 2 and 4 ranks for each communication configuration.

For every (ranks, configuration) pair this runs a recipe (``--recipe resnet50``, the default,
or ``transformer``, the translation Transformer) for a fixed number of steps with a fixed batch
per rank (weak scaling, as ChainerMN measured), then writes:

* ``results.json``: every run's throughput (images/s, or target tokens/s for the Transformer),
  final top-1 and time to the target accuracy (ResNet-50) or validation loss (Transformer);
* ``scaling.md``: the table, with parallel efficiency ``e = t / (t0 * n)`` (published
  definition; ``t0`` = the 1-rank fp32 throughput, ``t`` = the throughput on ``n`` ranks);
* ``scaling.png``: throughput against ranks, with the ideal line (needs matplotlib).

    python -m recipes.scaling --out scaling-out                       # emulated 1 Gbit/s links
    python -m recipes.scaling --ranks 1,2 --configs fp32,qsgd4 --steps 10 --launcher mpirun
    python -m recipes.scaling --dry-run                               # print the commands only
    python -m recipes.scaling --recipe transformer --out scaling-tf   # the Transformer, 1/2/4 ranks

``--launcher commopt`` (the default, with ``--link 1gbit``) starts each run with
``commopt launch -n N --link RATE``, one emulated host per rank; where that emulated
cluster cannot be made (no root, no network namespaces) the script says so and falls back
to ``mpirun`` on loopback. Anything after ``--`` goes to the recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from commopt.commands.launch import launch_argv
from commopt.tables import table
from commopt.testbed.mpirun import LOOPBACK_MCA

DEFAULT_CONFIGS = ("fp32", "fp16", "qsgd4", "fp32+db", "fp16+db", "qsgd4+db")
MPIRUN_LOCAL = [
    "mpirun",
    "--allow-run-as-root",
    "--oversubscribe",
    "--bind-to",
    "none",
    "--mca",
    "btl",
    "self,tcp,vader",
    *LOOPBACK_MCA,
]


def config_flags(label: str) -> list[str]:
    """Recipe flags of a configuration: ``fp32``, ``fp16``, ``CODEC``, each with ``+db``.

    >>> config_flags("fp16+db")
    ['--allreduce-grad-dtype', 'float16', '--double-buffering']
    >>> config_flags("qsgd4")
    ['--compression', 'qsgd4']
    """
    name = label.strip().lower()
    flags: list[str] = []
    if name.endswith("+db"):
        name = name[:-3]
        flags_db = ["--double-buffering"]
    else:
        flags_db = []
    if name in ("fp32", ""):
        pass
    elif name == "fp16":
        flags += ["--allreduce-grad-dtype", "float16"]
    elif name == "bf16":
        flags += ["--allreduce-grad-dtype", "bfloat16"]
    else:
        flags += ["--compression", name]
    return flags + flags_db


def recipe_command(args, n: int, label: str, log_path: Path) -> list[str]:
    if getattr(args, "recipe", "resnet50") == "transformer":
        return transformer_command(args, n, label, log_path)
    cmd = [
        sys.executable,
        "-m",
        "recipes.resnet50.train",
        "--preset",
        args.preset,
        "--batch-size",
        str(args.per_rank_batch * n),
        "--max-steps",
        str(args.steps),
        "--eval-every-steps",
        str(args.eval_every_steps),
        "--progress",
        "none",
        "--log-jsonl",
        str(log_path),
        "--log-every",
        "1",
        "--seed",
        str(args.seed),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd + config_flags(label) + list(args.recipe_args)


def transformer_command(args, n: int, label: str, log_path: Path) -> list[str]:
    """The Transformer recipe's command: ``--per-rank-batch`` is padded tokens per rank
    (``--max-tokens``), so the work per rank stays fixed as ranks are added.

        >>> import argparse
        >>> a = argparse.Namespace(
        ...     preset="smoke",
        ...     per_rank_batch=2000,
        ...     steps=20,
        ...     eval_every_steps=5,
        ...     seed=0,
        ...     threads=1,
        ...     recipe_args=[],
        ... )
        >>> " ".join(transformer_command(a, 2, "qsgd4+db", Path("/t/x.jsonl"))[2:])[:60]
        'recipes.transformer.train --preset smoke --max-tokens 2000 -'
    """
    cmd = [
        sys.executable,
        "-m",
        "recipes.transformer.train",
        "--preset",
        args.preset,
        "--max-tokens",
        str(args.per_rank_batch),
        "--max-update",
        str(args.steps),
        "--max-epoch",
        "0",
        "--validate-interval-updates",
        str(args.eval_every_steps),
        "--log-interval",
        "1",
        "--json-log",
        str(log_path),
        "--no-save",
        "--reset",
        "--save-dir",
        str(log_path.with_suffix("")),
        "--no-progress-bar",
        "--final-eval",
        "none",
        "--seed",
        str(args.seed),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd + config_flags(label) + list(args.recipe_args)


def throughput(row: dict):
    """A run's samples per second: ``throughput``, or ``images_per_s`` of older result files."""
    return row.get("throughput", row.get("images_per_s"))


def one_rank_fp32(results: list[dict]):
    """The throughput of fp32 on one rank, the baseline of the efficiencies (None if not run)."""
    return next(
        (
            throughput(r)
            for r in results
            if r["ranks"] == 1 and r["config"] == "fp32" and throughput(r)
        ),
        None,
    )


def read_transformer_run(log_path: Path, target_loss: float) -> dict:
    """Target tokens/s, final validation loss and time to ``target_loss`` (bits/token, training
    time) from the Transformer recipe's JSON lines.

        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "log.jsonl"
        >>> _ = p.write_text(
        ...     "\\n".join(
        ...         json.dumps(r)
        ...         for r in [
        ...             {"event": "train", "update": 1, "wps": 90.0, "train_time": 1.0},
        ...             {"event": "train", "update": 2, "wps": 100.0, "train_time": 2.0},
        ...             {"event": "valid", "update": 2, "loss": 5.5},
        ...             {"event": "train", "update": 3, "wps": 110.0, "train_time": 3.0},
        ...             {"event": "valid", "update": 3, "loss": 4.5},
        ...         ]
        ...     )
        ... )
        >>> r = read_transformer_run(p, target_loss=5.0)
        >>> r["throughput"], r["valid_loss"], r["time_to_target_s"], r["step_at_target"]
        (105.0, 4.5, 3.0, 3)
    """
    if not log_path.is_file():
        return {}
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("event") == "train"]
    valid = [r for r in records if r.get("event") == "valid"]
    # The first update pays for start-up (allocation, first buckets): left out of the rate.
    rates = [r["wps"] for r in train[1:] if r.get("wps")] or [
        r["wps"] for r in train if r.get("wps")
    ]
    hit = next((v for v in valid if v["loss"] <= target_loss), None)
    at_hit = [t for t in train if hit and t["update"] <= hit["update"]]
    return {
        "throughput": sum(rates) / len(rates) if rates else None,
        "valid_loss": valid[-1]["loss"] if valid else None,
        "steps": train[-1]["update"] if train else None,
        "time_to_target_s": at_hit[-1]["train_time"] if at_hit else None,
        "step_at_target": hit["update"] if hit else None,
    }


def emulated_link_available(link: str) -> tuple[bool, str]:
    """Can ``commopt launch --link`` make a 2-host cluster here? (ok, reason)."""
    probe = [*launch_argv(2, "--link", link, "--timeout", "60", "--"), sys.executable, "-c", "pass"]
    try:
        res = subprocess.run(probe, capture_output=True, text=True, timeout=90)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"probe failed: {exc}"
    if res.returncode == 0:
        return True, "ok"
    lines = (res.stderr or res.stdout).strip().splitlines()
    return False, lines[-1] if lines else f"exit code {res.returncode}"


def launch_prefix(launcher: str, n: int, link: str | None) -> list[str]:
    if launcher == "commopt":
        prefix = launch_argv(n)
        return prefix + (["--link", link] if link else []) + ["--"]
    return MPIRUN_LOCAL + ["-np", str(n), "-x", "PYTHONPATH"]


def read_run(log_path: Path, target: float) -> dict:
    """Throughput, final top-1 and time to ``target`` top-1 from a run's JSON lines."""
    if not log_path.is_file():
        return {}
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    done = next((r for r in reversed(records) if r.get("event") == "done"), {})
    evals = [r for r in records if r.get("event") == "eval"]
    reached = next((r for r in evals if r["top1"] >= target), None)
    return {
        "images_per_s": done.get("images_per_s"),
        "top1": done.get("top1"),
        "steps": done.get("steps"),
        "time_to_target_s": reached["train_s"] if reached else None,
        "step_at_target": reached["step"] if reached else None,
    }


def run_one(cmd, env, repo, log_path: Path, err_path: Path, label: str, n: int, args) -> dict:
    """Run one recipe command; its row (throughput etc. from the JSON lines)."""
    log_path.unlink(missing_ok=True)
    print(f"scaling: {label} on {n} rank(s) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=args.timeout
        )
        code, tail = proc.returncode, (proc.stderr or "")[-2000:]
    except subprocess.TimeoutExpired:
        code, tail = 124, f"timed out after {args.timeout:.0f}s"
    err_path.write_text(tail)
    row = {
        "config": label,
        "ranks": n,
        "exit_code": code,
        "wall_s": round(time.perf_counter() - t0, 1),
        "command": shlex.join(cmd),
        **(
            read_transformer_run(log_path, args.target_loss)
            if getattr(args, "recipe", "resnet50") == "transformer"
            else read_run(log_path, args.target_top1)
        ),
    }
    if code != 0:
        print(
            f"scaling: {label} on {n} rank(s) failed (exit {code}); see {err_path}", file=sys.stderr
        )
    else:
        print(
            f"scaling: {label} on {n} rank(s): {throughput(row)} samples/s",
            file=sys.stderr,
            flush=True,
        )
    return row


def best_of(rows: list[dict]) -> dict:
    """The repeat with the highest throughput (the least disturbed by other work on the
    machine); every repeat's figures stay in ``samples``."""
    ok = [r for r in rows if r["exit_code"] == 0 and throughput(r)]
    best = dict(max(ok, key=throughput) if ok else rows[0])
    best["samples"] = [
        {
            k: r.get(k)
            for k in (
                "images_per_s",
                "throughput",
                "time_to_target_s",
                "top1",
                "valid_loss",
                "exit_code",
            )
        }
        for r in rows
    ]
    return best


def efficiency_table(results: list[dict], ranks: list[int], configs: list[str]) -> list[dict]:
    """Adds ``efficiency`` = t / (t0 * n), t0 the 1-rank fp32 throughput."""
    t0 = one_rank_fp32(results)
    for r in results:
        t = throughput(r)
        r["efficiency"] = round(t / (t0 * r["ranks"]), 3) if (t and t0) else None
    return results


def markdown(results: list[dict], ranks: list[int], configs: list[str], meta: dict) -> str:
    unit = meta.get("unit", "img/s")
    goal = meta.get("target_name", "top-1")
    head = (
        ["configuration"]
        + [f"{n} rank{'s' * (n > 1)}: {unit} (e)" for n in ranks]
        + [f"time to {goal} {meta['target']:g} at {max(ranks)} ranks (s)"]
    )
    rows = []
    for c in configs:
        cells = []
        for n in ranks:
            r = next((x for x in results if x["ranks"] == n and x["config"] == c), None)
            if not r or not throughput(r):
                cells.append("failed" if r else "-")
            else:
                e = f" ({r['efficiency']:.2f})" if r.get("efficiency") is not None else ""
                cells.append(f"{throughput(r):.1f}{e}")
        top = next((x for x in results if x["ranks"] == max(ranks) and x["config"] == c), {})
        ttt = top.get("time_to_target_s")
        rows.append([c, *cells, "not reached" if ttt is None else f"{ttt:.1f}"])
    best = f", fastest of {meta['repeats']} runs" if meta.get("repeats", 1) > 1 else ""
    per = meta.get("per_rank_unit", "images")
    notes = [
        f"\nLink: {meta['link_note']}. {meta['steps']} steps{best}, {meta['per_rank_batch']} {per} "
        f"per rank per step, preset {meta['preset']}; e = t / (t0 * n) with t0 the 1-rank fp32 "
        "throughput. Physical limit here: the ranks share this machine's "
        f"{os.cpu_count()} cores, so compute alone caps n-rank throughput at about "
        f"min(n, {os.cpu_count()}) x t0."
    ]
    return "\n".join([table(head, rows, markdown=True, align="l" * len(head))] + notes)


def plot(
    results: list[dict],
    ranks: list[int],
    configs: list[str],
    path: Path,
    unit: str = "images/s",
    title: str = "ResNet-50",
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "scaling: matplotlib is not installed (pip install matplotlib): no plot",
            file=sys.stderr,
        )
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    t0 = one_rank_fp32(results)
    for c in configs:
        pts = [(r["ranks"], throughput(r)) for r in results if r["config"] == c and throughput(r)]
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=c)
    if t0:
        ax.plot(ranks, [t0 * n for n in ranks], "k--", label="ideal (n x t0)")
    ax.set_xlabel("ranks")
    ax.set_ylabel(unit)
    ax.set_xticks(ranks)
    ax.set_title(f"{title} data-parallel throughput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.scaling",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--recipe",
        choices=("resnet50", "transformer"),
        default="resnet50",
        help="resnet50 (images/s, top-1) or transformer (target tokens/s, validation "
        "loss in bits/token; --per-rank-batch is then --max-tokens per rank)",
    )
    p.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="fp32, fp16, bf16 or a codec (qsgd4, qsgd4+ef...), each optionally +db",
    )
    p.add_argument(
        "--launcher",
        choices=("commopt", "mpirun"),
        default="commopt",
        help="commopt: `commopt launch -n N --link RATE`; mpirun: loopback",
    )
    p.add_argument(
        "--link",
        default="1gbit",
        help="emulated link rate for --launcher commopt ('none': commopt launch without shaping)",
    )
    p.add_argument("--preset", default="smoke")
    p.add_argument("--steps", type=int, default=20, help="steps per run")
    p.add_argument(
        "--per-rank-batch",
        type=int,
        help="images per rank (default 16), or padded tokens per rank for the "
        "Transformer (default 2000)",
    )
    p.add_argument("--eval-every-steps", type=int, default=5)
    p.add_argument("--target-top1", type=float, default=0.5)
    p.add_argument(
        "--target-loss",
        type=float,
        default=6.0,
        help="Transformer: validation loss (bits/token) whose time is reported",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each (configuration, ranks), round robin; the table keeps the "
        "fastest (least disturbed) of them",
    )
    p.add_argument("--out", default="scaling-out", help="output folder")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: more recipe options")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.recipe_args = [a for a in args.recipe_args if a != "--"]
    transformer = args.recipe == "transformer"
    if args.per_rank_batch is None:
        args.per_rank_batch = 2000 if transformer else 16
    try:
        ranks = sorted({int(x) for x in args.ranks.split(",") if x.strip()})
    except ValueError:
        print(f"scaling: error: --ranks {args.ranks}: give integers like 1,2,4", file=sys.stderr)
        return 2
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not ranks or min(ranks) < 1 or not configs or args.steps < 2 or args.repeats < 1:
        print(
            "scaling: error: need ranks >= 1, at least one configuration, --steps >= 2 "
            "and --repeats >= 1",
            file=sys.stderr,
        )
        return 2
    if args.launcher == "mpirun" and shutil.which("mpirun") is None:
        print(
            "scaling: error: mpirun not found: install Open MPI (apt-get install openmpi-bin)",
            file=sys.stderr,
        )
        return 2
    link = None if args.link in ("none", "") else args.link
    launcher, link_note = args.launcher, "loopback (mpirun, no shaping)"
    if launcher == "commopt":
        link_note = (
            f"emulated {link} links, one host per rank (commopt launch)"
            if link
            else "commopt launch, no shaping"
        )
        if link and not args.dry_run:
            ok, why = emulated_link_available(link)
            if not ok:
                print(
                    f"scaling: the emulated {link} cluster is not available here ({why}); "
                    "falling back to mpirun on loopback: the numbers show this machine's "
                    "loopback, not a slow link",
                    file=sys.stderr,
                )
                launcher, link_note = (
                    "mpirun",
                    f"loopback (mpirun; emulated {link} unavailable: {why})",
                )
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    samples = []
    # Round robin over the repeats: a slow spell on a shared machine hits every configuration.
    for rep in range(args.repeats):
        for label in configs:
            for n in ranks:
                name = f"{label}-n{n}" + (f"-r{rep}" if args.repeats > 1 else "")
                log_path = (out / "runs" / f"{name}.jsonl").resolve()
                cmd = launch_prefix(launcher, n, link) + recipe_command(args, n, label, log_path)
                if args.dry_run:
                    print(shlex.join(cmd))
                    continue
                samples.append(
                    run_one(
                        cmd, env, repo, log_path, out / "runs" / f"{name}.stderr", label, n, args
                    )
                )
        if args.dry_run:
            return 0
    results = [
        best_of([x for x in samples if x["config"] == c and x["ranks"] == n])
        for c in configs
        for n in ranks
    ]
    efficiency_table(results, ranks, configs)
    meta = {
        "link_note": link_note,
        "launcher": launcher,
        "steps": args.steps,
        "repeats": args.repeats,
        "per_rank_batch": args.per_rank_batch,
        "preset": args.preset,
        "target": args.target_loss if transformer else args.target_top1,
        "recipe": args.recipe,
        "unit": "tokens/s" if transformer else "img/s",
        "target_name": "valid loss" if transformer else "top-1",
        "per_rank_unit": "tokens" if transformer else "images",
        "cores": os.cpu_count(),
        "command": shlex.join([sys.executable, "-m", "recipes.scaling", *(argv or sys.argv[1:])]),
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    table = markdown(results, ranks, configs, meta)
    (out / "scaling.md").write_text(table + "\n")
    plotted = plot(
        results,
        ranks,
        configs,
        out / "scaling.png",
        *(("target tokens/s", "Transformer") if transformer else ()),
    )
    print(table)
    print(
        f"\nwrote {out / 'results.json'}, {out / 'scaling.md'}"
        + (f", {out / 'scaling.png'}" if plotted else "")
    )
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
