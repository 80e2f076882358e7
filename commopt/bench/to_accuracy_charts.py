"""Charts of `commopt bench to_accuracy` result files: loss against wall time, and speed-ups.

From any number of result files (``--from-json``, once per file): the runs of one task and
setting are merged (``to_accuracy_report.merge_reports``), and for each of them a chart of
validation loss against training wall time (``tta-TASK-SETTING.png``: every seed a thin
line, their mean a thick one), then one summary chart of every configuration's speed-up
against DDP fp32 (time to the target), one group of bars per task and setting
(``tta-speedup.png``). matplotlib is imported only here, and a missing one is named with
its fix.

    $ commopt bench to_accuracy --charts docs/plots \\
          --from-json benchmarks/results/tta-text-linkbound-seed0.json \\
          --from-json benchmarks/results/tta-digits-linkbound-seed0.json
"""

from __future__ import annotations

from pathlib import Path

from commopt.bench.to_accuracy_report import (
    REFERENCE,
    merge_reports,
    plot,
    read_report,
    summarize,
)

SUMMARY_NAME = "tta-speedup.png"


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "commopt bench to_accuracy --charts needs matplotlib: pip install matplotlib"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def group_reports(reports: list[dict]) -> dict[tuple[str, str], dict]:
    """(task, setting) -> the merged report of that task and setting's runs, in the order
    first seen. Reports without a setting are the compute-heavy setting (they predate it)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for report in reports:
        key = (report.get("task", "text"), report.get("setting") or "compute-heavy")
        groups.setdefault(key, []).append(report)
    return {
        key: (members[0] if len(members) == 1 else merge_reports(members))
        for key, members in groups.items()
    }


def speedups(report: dict) -> list[tuple[str, float | None, str]]:
    """(label, speed-up against DDP fp32 in time to the target, why there is none: "failed"
    or "did not reach the target" on every seed, else "") for every configuration of
    ``report`` but DDP fp32."""
    out = []
    for row in summarize(report):
        if row["config"] == REFERENCE:
            continue
        value = row.get("speedup_vs_ddp_fp32")
        why = (
            "" if value is not None else "failed" if "error" in row else "did not reach the target"
        )
        out.append((row["label"], value, why))
    return out


def speedup_chart(groups: dict[tuple[str, str], dict], path: str | Path) -> Path:
    """One horizontal bar per configuration and (task, setting): its speed-up against DDP
    fp32; a configuration that failed or did not reach the target is a grey cross at 0,
    labelled with the reason; a dotted line at 1 (DDP fp32)."""
    plt = _matplotlib()
    blocks = [(key, speedups(report)) for key, report in groups.items()]
    n_bars = sum(len(rows) for _, rows in blocks) + len(blocks)
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.22 * n_bars + 1.0)))
    colours = plt.get_cmap("tab10")
    y = 0
    ticks, labels = [], []
    for k, ((task, setting), rows) in enumerate(blocks):
        for label, value, why in rows:
            if value is None:
                ax.plot([0], [y], "x", color="grey")
                ax.text(0.05, y, why, va="center", fontsize=6)
            else:
                ax.barh(y, value, color=colours(k % 10), height=0.8)
                ax.text(value, y, f" {value:.2f}x", va="center", fontsize=6)
            ticks.append(y)
            labels.append(f"{task}, {setting}: {label}")
            y += 1
        y += 1  # a gap between the groups
    ax.axvline(1.0, color="black", linestyle=":", linewidth=1)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up against DDP fp32 (time to the target; higher is better)")
    ax.set_title("Time to accuracy: every configuration against DDP fp32", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_charts(specs: list[str], out_dir: str | Path) -> list[Path]:
    """The loss charts (one per task and setting) and the summary chart of the result files
    ``specs`` (paths, or ``PATH#CONFIG,CONFIG``) under ``out_dir``; the paths written."""
    _matplotlib()  # fail before any work when it is missing
    groups = group_reports([read_report(spec) for spec in specs])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (task, setting), report in groups.items():
        path = out / f"tta-{task}-{setting}.png"
        plot(report, str(path))
        written.append(path)
    written.append(speedup_chart(groups, out / SUMMARY_NAME))
    return written
