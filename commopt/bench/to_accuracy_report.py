"""Time to accuracy from loss curves: the target, when each configuration reached it, the table.

A curve is a list of ``(step, training wall seconds, validation loss)`` points. The target is
the reference configuration's (DDP fp32's) validation loss at the end of the budget, raised
by ``tolerance`` (relative, default 1%: fp32's own curve is still falling there, so an exact
tie would be decided by noise); a configuration reaches it at its first evaluation at or below.

    >>> reached([(0, 0.0, 4.6), (10, 5.0, 3.0), (20, 10.0, 2.5)], 2.9)
    (20, 10.0)
    >>> reached([(0, 0.0, 4.6), (10, 5.0, 3.0)], 2.9) is None
    True
"""

from __future__ import annotations

import json
from pathlib import Path

from commopt.bench.step.configs import CONFIGS, allreduce_limit_s

REFERENCE = "ddp-fp32"


def reached(curve, target: float):
    """(steps, wall seconds) of the first point of ``curve`` at or below ``target``; else None."""
    for step, wall, loss in curve:
        if loss <= target:
            return step, wall
    return None


def target_loss(report: dict) -> float:
    """DDP fp32's loss at the budget x (1 + the report's ``tolerance``)."""
    return report["runs"][REFERENCE]["curve"][-1][2] * (1 + report.get("tolerance", 0.0))


def summarize(report: dict) -> list[dict]:
    """One row per configuration: time and steps to the target, final loss, the link's limit."""
    runs = report["runs"]
    if REFERENCE not in runs or "curve" not in runs[REFERENCE]:
        why = runs.get(REFERENCE, {}).get("error")
        if why:
            raise ValueError(f"{REFERENCE} (the target) did not finish: {why}")
        raise ValueError(f"the target is {REFERENCE}'s final loss: run {REFERENCE} too")
    target = target_loss(report)
    rows = []
    for name, run in runs.items():
        if "curve" not in run:
            rows.append({"config": name, "label": CONFIGS[name].label, "error": run.get("error")})
            continue
        hit = reached(run["curve"], target)
        times = sorted(run["step_times"])
        limit = allreduce_limit_s(run["wire_bytes"], report["nprocs"], report.get("rate_bits"))
        rows.append(
            {
                "config": name,
                "label": CONFIGS[name].label,
                "target": target,
                "reached": hit is not None,
                "steps_to_target": hit[0] if hit else None,
                "wall_to_target_s": hit[1] if hit else None,
                "final_loss": run["curve"][-1][2],
                "median_step_s": times[len(times) // 2],
                "wire_mb": run["wire_bytes"] / 1e6,
                "link_limit_step_s": limit,
            }
        )
    ref = next(r for r in rows if r["config"] == REFERENCE)["wall_to_target_s"]
    for r in rows:
        if r.get("wall_to_target_s"):
            r["speedup_vs_ddp_fp32"] = ref / r["wall_to_target_s"]
    return rows


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(report: dict, rows: list[dict]) -> str:
    """The table of ``rows`` as markdown, with the command and the setting above it."""
    target = rows[0].get("target")
    again = f" (table: `{report['rendered_by']}`)" if report.get("rendered_by") else ""
    head = (
        f"Command: `{report['command']}`{again}  \n{report['nprocs']} ranks, {report['link']}; "
        f"{report['model']}; budget {report['budget']} steps, evaluation every "
        f"{report['eval_every']}; target = {REFERENCE}'s validation loss at the budget "
        f"+ {100 * report.get('tolerance', 0):g}% ({_f(target, '.4f')}); {report['machine']}, load average "
        f"{report['load_average_start']:.1f} at the start; {report['date']}.\n\n"
    )
    lines = [
        "| configuration | reached | wall to target (s) | steps to target | x DDP fp32 | "
        "final loss | median step (s) | wire MB/step | link limit/step (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} |" + " |" * 7)
            continue
        lines.append(
            f"| {r['label']} | {'yes' if r['reached'] else 'no'} | "
            f"{_f(r['wall_to_target_s'], '.1f')} | {_f(r['steps_to_target'], 'd')} | "
            f"{_f(r.get('speedup_vs_ddp_fp32'), '.2f')} | {r['final_loss']:.4f} | "
            f"{r['median_step_s']:.3f} | {r['wire_mb']:.1f} | "
            f"{_f(r['link_limit_step_s'], '.3f')} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    """A PNG of validation loss against training wall time, one line per configuration."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, run in report["runs"].items():
        if "curve" in run:
            ax.plot(
                [p[1] for p in run["curve"]],
                [p[2] for p in run["curve"]],
                marker=".",
                label=CONFIGS[name].label,
            )
    target = target_loss(report)
    ax.axhline(target, color="grey", linestyle="--", label=f"target ({target:.3f})")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(f"Time to accuracy, {report['nprocs']} ranks, {report['link']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(report: dict, args) -> None:
    if getattr(args, "tolerance", None) is not None:
        report["tolerance"] = args.tolerance
    rows = report["rows"] = summarize(report)
    print(markdown(report, rows), flush=True)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(report, indent=1))
    if getattr(args, "markdown", None):
        Path(args.markdown).write_text(markdown(report, rows))
    if getattr(args, "plot", None):
        plot(report, args.plot)
