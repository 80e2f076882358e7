"""The step benchmark's report: the table (terminal and markdown), the markdown page, the plot.

>>> from commopt.bench.step.figures import Row
>>> table_cells(Row("ddp-fp32", "DDP fp32", "ddp", step_s=0.812, speedup=1.0))[:2]
['ddp-fp32', '812']
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from commopt.bench.step.configs import CONFIGS
from commopt.bench.step.figures import Row
from commopt.bench.step.sim_export import sim_measurements
from commopt.tables import table

if TYPE_CHECKING:  # matplotlib is optional and imported where a plot is drawn
    from matplotlib.artist import Artist


def _fmt(value, spec, unit=""):
    return "-" if value is None else format(value, spec) + unit


TABLE_COLUMNS = (
    "configuration",
    "step ms (rounds)",
    "compute ms",
    "rank CPU ms",
    "link limit ms",
    "codec ms",
    "floor ms",
    "step/floor",
    "bound",
    "samples/s",
    "speed-up",
    "efficiency",
    "comm wait",
    "final loss",
)


def table_cells(row: Row) -> list[str]:
    """The row's cells under ``TABLE_COLUMNS``, formatted (a failed row: its error, short)."""
    if row.error:
        lines = [ln for ln in row.error.splitlines() if ln.strip()]
        why = lines[-1].split("]:", 1)[-1].strip()[:70]  # the exception, not the log path
        return [row.config, "failed: " + why]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    pct = lambda v: None if v is None else v * 100  # noqa: E731
    step = _fmt(ms(row.step_s), ".0f")
    if row.step_rounds and len(row.step_rounds) > 1:
        step += f" ({min(row.step_rounds) * 1e3:.0f}-{max(row.step_rounds) * 1e3:.0f})"
    return [
        row.config,
        step,
        _fmt(ms(row.compute_s), ".0f"),
        _fmt(ms(row.cpu_s), ".0f"),
        _fmt(ms(row.limit_s), ".0f"),
        _fmt(ms(row.codec_s), ".0f"),
        _fmt(ms(row.floor_s), ".0f"),
        _fmt(row.floor_ratio, ".2f", "x"),
        row.bound or "-",
        _fmt(row.samples_per_s, ".1f"),
        _fmt(row.speedup, ".2f", "x"),
        _fmt(pct(row.efficiency), ".0f", "%"),
        _fmt(pct(row.comm_wait), ".0f", "%"),
        _fmt(row.final_loss, ".4f"),
    ]


def format_table(rows: list[Row]) -> str:
    """The rows as a text table for the terminal, one line per configuration."""
    return table(TABLE_COLUMNS, [table_cells(r) for r in rows])


def markdown_table(rows: list[Row]) -> str:
    """The rows as a markdown table."""
    return table(TABLE_COLUMNS, [table_cells(r) for r in rows], markdown=True)


def print_model(
    model: str, info: dict, rows: list[Row], n: int, plan, targets: bool = True
) -> None:
    """One model's table, its physical limit (or the link ``plan`` ran on) and its targets."""
    print(f"\n{model}: {info['description']}; batch {info['batch_per_rank']} per rank, {n} ranks")
    print(format_table(rows))
    if info["fp32_allreduce_limit_s"] is not None:
        print(
            f"physical limit: the fp32 gradient ({info['params'] * 4 / 1e6:.1f} MB) needs "
            f"{info['fp32_allreduce_limit_s'] * 1e3:.0f} ms per allreduce on this link "
            f"(2(n-1)/n x bytes / rate)"
        )
    else:
        print(f"link: {plan.description}; no physical limit to compare with")
    for row in rows:
        if row.ranks_agree is False:
            print(f"warning: {row.config}: the ranks' parameters differ after training")
    for line in info["targets"] if targets else []:
        print("target: " + line)
    profiled = _profiles({"models": {model: info}})
    if profiled:
        from commopt.bench.profile_report import profile_table

        print("\nprofile of rank 0, ms per step (time in each phase's ranges; CPU: each thread's):")
        print(profile_table(profiled))
    print(flush=True)


def _profiles(report: dict) -> list[tuple[str, dict, dict]]:
    from commopt.bench.profile_report import report_entries

    return report_entries(report)


def markdown_report(report: dict) -> str:
    """The results as markdown: the command, the link, one table per model, the targets."""
    out = [
        f"Command: `{report['command']}`",
        "",
        f"Link: {report['link']}; {report['nprocs']} ranks, one per host; "
        f"{report['threads_per_rank']} thread(s) per rank; machine: {report['machine']}; "
        f"torch {report['torch']}; load average {report['load_average_start']:.1f} at the "
        f"start, {report['load_average_end']:.1f} at the end; {report['date']}.",
        "",
    ]
    for model, info in report["models"].items():
        rows = [Row(**r) for r in info["rows"]]
        out += [
            f"### {model}: {info['description']}",
            "",
            f"Batch {info['batch_per_rank']} per rank; {report['rounds']} round(s), each "
            f"{report['warmup']} warm-up and {info['steps']} timed steps per configuration; "
            f"median over rounds of each round's median.",
            "",
            *(
                [
                    "Local-steps configurations (`local-steps`, `torchft-diloco`): each round's "
                    "step time is the mean over whole synchronisation cycles of H steps (the "
                    "timed blocks rounded up to whole cycles), not a median, which would show "
                    "only the steps that send nothing; their link limit is that of the wire "
                    "bytes per step averaged over a cycle.",
                    "",
                ]
                if any(CONFIGS[r.config].local_steps for r in rows if r.config in CONFIGS)
                else []
            ),
            markdown_table(rows),
            "",
        ]
        if info["fp32_allreduce_limit_s"] is not None:
            out += [
                f"Physical limit: the fp32 gradient ({info['params'] * 4 / 1e6:.1f} MB) "
                f"needs {info['fp32_allreduce_limit_s'] * 1e3:.0f} ms per allreduce on this "
                f"link.",
                "",
            ]
        out += [f"- target: {t}" for t in info["targets"]] + [""]
        profiled = _profiles({"models": {model: info}})
        if profiled:
            from commopt.bench.profile_report import profile_table

            out += [
                "Profile of rank 0, ms per step (time in each phase's ranges; CPU: each thread's):",
                "",
                profile_table(profiled, markdown=True),
                "",
            ]
    return "\n".join(out)


def plot_step_times(report: dict, path: str) -> None:
    """Bar chart of step time per configuration, one panel per model."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "the step-time plot needs matplotlib: pip install matplotlib (or commopt[plot])"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5.8), squeeze=False)
    colors = {"ddp": "#d95f02", "commopt": "#1b9e77"}
    for ax, model in zip(axes[0], models):
        info = report["models"][model]
        rows = [r for r in info["rows"] if r["step_s"] is not None][::-1]
        names = [r["config"] for r in rows]
        ax.barh(names, [r["step_s"] * 1e3 for r in rows], color=[colors[r["kind"]] for r in rows])
        ax.barh(
            names,
            [(r["compute_s"] or 0) * 1e3 for r in rows],
            height=0.3,
            color="#333333",
            label="compute only (same moment, no communication)",
        )
        for y, r in enumerate(rows):
            if r["speedup"] is not None:
                right = max(r["step_s"], r["compute_s"] or 0) * 1e3
                ax.annotate(
                    f"{r['speedup']:.1f}x",
                    (right, y),
                    xytext=(3, -3),
                    textcoords="offset points",
                    fontsize=8,
                )
        if info["fp32_allreduce_limit_s"]:
            ax.axvline(
                info["fp32_allreduce_limit_s"] * 1e3,
                ls="--",
                color="k",
                lw=1,
                label="fp32 allreduce, link limit",
            )
        ax.set_xlabel("step time, ms (median; label: speed-up over ddp-fp32)")
        params = f"{info['params'] / 1e6:.2f}M params, " if info.get("params") else ""
        ax.set_title(f"{model}: {params}batch {info['batch_per_rank']}/rank", fontsize=10)
        ax.margins(x=0.12)
    # One legend for the figure, centred under it: under a single narrow panel a legend of its
    # own ran past the right edge. bbox_inches="tight" keeps whatever sticks out in the picture.
    legend: dict[str, Artist] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.suptitle(f"{report['nprocs']} ranks, {report['link']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.legend(
        list(legend.values()),
        list(legend),
        fontsize=8,
        loc="lower center",
        ncol=len(legend),
        bbox_to_anchor=(0.5, 0.0),
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_outputs(report: dict, args) -> None:
    """The files ``args`` asks for: --json, --markdown, --sim-measurements, --plot."""
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(markdown_report(report))
        print(f"wrote {args.markdown}")
    if getattr(args, "sim_measurements", None):
        try:
            entries = sim_measurements(report)
        except ValueError as exc:
            raise SystemExit(f"commopt bench step: {exc}") from None
        Path(args.sim_measurements).write_text(json.dumps(entries, indent=1) + "\n")
        print(f"wrote {args.sim_measurements} ({len(entries)} entries)")
    if getattr(args, "profile_plot", None):
        from commopt.bench.profile_report import plot_profile

        profiles = _profiles(report)
        if profiles:
            plot_profile(profiles, args.profile_plot, title=report["link"])
            print(f"wrote {args.profile_plot}")
    if args.plot:
        try:
            plot_step_times(report, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as exc:  # the tables matter more than the picture
            print(f"no plot: {exc}")
