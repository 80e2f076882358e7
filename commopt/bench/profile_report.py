"""The step profile's report: ms per step per thread and phase as a table and a stacked-bar plot.

Reads what :mod:`commopt.bench.profile_step` recorded (``commopt bench step --profile``); run
on saved reports to put several side by side (shaped and unshaped links)::

    python -m commopt.bench.profile_report step-1gbit.json step-unshaped.json \\
        --markdown profile.md --plot profile.png
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from commopt.bench.profile_step import PHASES

if TYPE_CHECKING:  # matplotlib is optional and imported where a plot is drawn
    from matplotlib.artist import Artist

#: Columns of the profile table: the phases ("other": the rest, see :func:`thread_rows`).
COLUMNS = PHASES

#: Profiles recorded by sampling stacks (their threads hold "samples", not "phase_s") name
#: some phases differently; they render in the current columns.
LEGACY_PHASES = {
    "NaN check": "pack",
    "send/receive": "transport",
    "wait/poll": "wait",
    "commopt Python": "other",
}

#: The order of the rows.
ROLE_ORDER = (
    "training",
    "collectives driver",
    "MPI worker",
    "gloo transport",
    "autograd",
    "other threads",
)


def _thread_phases(t: dict, steps: int) -> dict[str, float]:
    """One thread's ms per step by phase, before "other"."""
    if "phase_s" in t:
        return {p: 1e3 * s / steps for p, s in t["phase_s"].items()}
    # a sampled profile: the thread's CPU split by its running samples
    running = sum(t.get("samples", {}).values())
    out: dict[str, float] = {}
    for phase, n in t.get("samples", {}).items():
        key = LEGACY_PHASES.get(phase, phase)
        out[key] = out.get(key, 0.0) + 1e3 * t["cpu_s"] / steps * n / running
    return out


def thread_rows(profile: dict) -> dict[str, dict[str, float]]:
    """One rank's profile -> role -> {phase: ms per step, "cpu", "not running", "switches",
    "preempted" per step}; roles sorted training first.

    A phase is the thread's time in that phase's ranges (their self-time). "other" is the
    rest: for the training thread, the profiled step's wall time outside every range (so its
    row adds up to the step); for any other thread, its CPU beyond its ranges' time (all of
    it for a thread that opens no range: gloo's transport loop, OpenMP's threads). "not
    running": the training thread's wall time without CPU (asleep in a wait, or runnable
    with no core free).
    """
    steps = profile["steps"]
    step_ms = 1e3 * profile["wall_s"] / steps
    rows: dict[str, dict[str, float]] = {}
    traced = False
    for t in profile["threads"].values():
        row = rows.setdefault(t["role"], {})
        cpu_ms = 1e3 * t["cpu_s"] / steps
        phases = _thread_phases(t, steps)
        if "phase_s" in t:
            traced = True
            if t["role"] != "training":  # the training thread's rest: below, from its wall
                phases["other"] = max(0.0, cpu_ms - sum(phases.values()))
        elif not phases:  # a sampled profile's thread the sampler could not see
            phases["other"] = cpu_ms
        for phase, ms in phases.items():
            row[phase] = row.get(phase, 0.0) + ms
        row["cpu"] = row.get("cpu", 0.0) + cpu_ms
        row["switches"] = row.get("switches", 0.0) + t.get("switches", 0) / steps
        row["preempted"] = row.get("preempted", 0.0) + t.get("preempted", 0) / steps
    if "training" in rows:
        row = rows["training"]
        if traced:
            row["other"] = max(0.0, step_ms - sum(row.get(p, 0.0) for p in PHASES if p != "other"))
        row["not running"] = max(0.0, step_ms - row["cpu"])
    return {
        k: rows[k]
        for k in sorted(rows, key=lambda r: ROLE_ORDER.index(r) if r in ROLE_ORDER else 99)
    }


def profile_table(entries: list[tuple[str, dict, dict]], markdown: bool = False) -> str:
    """A table of ms per step: for each (label, rank's profile, row figures) its threads by
    phase and all threads together; under it, each profiled step beside the same steps
    without the profiler, the timed step and its floor. The training thread's phases and
    "other" add up to its profiled step.

        >>> prof = {
        ...     "steps": 2,
        ...     "wall_s": 0.2,
        ...     "step_times": [0.1, 0.1],
        ...     "plain_step_times": [0.08, 0.08],
        ...     "threads": {
        ...         "1": {
        ...             "role": "training",
        ...             "cpu_s": 0.1,
        ...             "phase_s": {"backward": 0.06, "pack": 0.02, "wait": 0.1},
        ...             "switches": 4,
        ...             "preempted": 2,
        ...         }
        ...     },
        ... }
        >>> text = profile_table([("x", prof, {"step_s": 0.1, "floor_s": 0.05})], markdown=True)
        >>> [c.strip() for c in text.splitlines()[2].split("|")[1:5]]
        ['x: training', '-', '30', '10']
        >>> text.splitlines()[-1]
        'x: profiled steps 100 ms on average, the same steps without the profiler 80 ms (+25%); timed step 100 ms; floor 50 ms (timed step / floor 2.00x)'
    """
    from commopt.tables import table

    head = ("thread", *COLUMNS, "CPU", "not running", "switches", "preempted")
    lines, notes = [], []
    fmt = lambda v: "-" if not v else f"{v:.1f}" if v < 10 else f"{v:.0f}"  # noqa: E731
    for label, prof, fig in entries:
        rows = thread_rows(prof)
        total: dict[str, float] = {}
        for role, row in rows.items():
            lines.append(
                [
                    f"{label}: {role}",
                    *(fmt(row.get(c)) for c in COLUMNS),
                    fmt(row["cpu"]),
                    fmt(row.get("not running")) if role == "training" else "",
                    fmt(row["switches"]),
                    fmt(row["preempted"]),
                ]
            )
            for k, v in row.items():
                total[k] = total.get(k, 0.0) + v
        lines.append(
            [
                f"{label}: all threads",
                *(fmt(total.get(c)) for c in COLUMNS),
                fmt(total.get("cpu")),
                "",
                fmt(total.get("switches")),
                fmt(total.get("preempted")),
            ]
        )
        profiled = 1e3 * prof["wall_s"] / prof["steps"]
        note = [f"profiled steps {profiled:.0f} ms on average"]
        if prof.get("plain_step_times"):
            plain = 1e3 * sum(prof["plain_step_times"]) / len(prof["plain_step_times"])
            note[0] += (
                f", the same steps without the profiler {plain:.0f} ms "
                f"({100 * (profiled / plain - 1):+.0f}%)"
            )
        if prof.get("plain_cpu_s"):
            note[0] += (
                f"; process CPU {1e3 * prof['cpu_s'] / prof['steps']:.0f} ms per step "
                f"against {1e3 * prof['plain_cpu_s'] / prof['steps']:.0f} "
                f"({100 * (prof['cpu_s'] / prof['plain_cpu_s'] - 1):+.0f}%)"
            )
        if fig.get("step_s"):
            note.append(f"timed step {fig['step_s'] * 1e3:.0f} ms")
            if fig.get("floor_s"):
                note.append(
                    f"floor {fig['floor_s'] * 1e3:.0f} ms (timed step / floor "
                    f"{fig['step_s'] / fig['floor_s']:.2f}x)"
                )
        notes.append(f"{label}: " + "; ".join(note))
    return "\n".join([table(head, lines, markdown=markdown), "", *notes])


#: One colour per phase in the stacked bars.
_COLOURS = {
    "forward": "#a6cee3",
    "backward": "#1f78b4",
    "pack": "#b2df8a",
    "encode": "#fb9a99",
    "transport": "#e31a1c",
    "wait": "#fdbf6f",
    "decode": "#ff7f00",
    "agree": "#33a02c",
    "unpack": "#cab2d6",
    "apply": "#6a3d9a",
    "other": "#bbbbbb",
}


def report_entries(
    report: dict, rank: str = "0", link_label: bool = False, only: list[str] | None = None
) -> list[tuple[str, dict, dict]]:
    """(label, rank's profile, row figures) of every profiled configuration of a step report
    (``only``: of those "model/config" or "config" names)."""
    out = []
    link = (report.get("link_rate") or "unshaped") if link_label else None
    for model, info in report["models"].items():
        rows = {r["config"]: r for r in info.get("rows", [])}
        for config, raw in info.get("raw", {}).items():
            prof = (raw.get("profile") or {}).get(rank)
            if prof and (not only or config in only or f"{model}/{config}" in only):
                label = f"{model} {config}" + (f" ({link})" if link else "")
                out.append((label, prof, rows.get(config, {})))
    return out


def plot_profile(entries: list[tuple[str, dict, dict]], path: str, title: str = "") -> None:
    """Stacked bars: each thread's ms per step by phase and its CPU, per profiled
    configuration, with the profiled step, the same steps without the profiler, the timed
    step and its floor marked."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the profile plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [len(thread_rows(p)) + 1 for _, p, _ in entries]
    fig, axes = plt.subplots(
        len(entries),
        1,
        figsize=(10, 1.6 + 0.32 * sum(heights)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    right = 0.0
    for ax, (label, prof, figs) in zip(axes[:, 0], entries):
        rows = thread_rows(prof)
        names = list(rows)[::-1]
        for y, role in enumerate(names):
            left = 0.0
            for phase in COLUMNS:
                v = rows[role].get(phase, 0.0)
                if v:
                    ax.barh(
                        y,
                        v,
                        left=left,
                        color=_COLOURS[phase],
                        label=phase,
                        edgecolor="white",
                        lw=0.3,
                    )
                    left += v
            ax.plot(
                [rows[role]["cpu"]] * 2,
                [y - 0.4, y + 0.4],
                color="k",
                lw=2,
                label="thread's CPU (its clock)",
            )
            right = max(right, left)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        step = figs.get("step_s")
        if step:
            ax.axvline(step * 1e3, color="k", lw=1.2, label="timed step (wall)")
            right = max(right, step * 1e3)
        if figs.get("floor_s"):
            ax.axvline(
                figs["floor_s"] * 1e3,
                color="k",
                ls="--",
                lw=1.2,
                label="floor: max(compute + codec, link)",
            )
        profiled = 1e3 * prof["wall_s"] / prof["steps"]
        ax.axvline(
            profiled,
            color="#777777",
            ls=":",
            lw=1.2,
            label="profiled step (wall)",
        )
        right = max(right, profiled)
        if prof.get("plain_step_times"):
            plain = 1e3 * sum(prof["plain_step_times"]) / len(prof["plain_step_times"])
            ax.axvline(plain, color="#777777", ls="-.", lw=1.2, label="the same steps, no profiler")
        ax.set_title(label, fontsize=9, loc="left")
    for ax in axes[:, 0]:
        ax.set_xlim(0, right * 1.05)
    axes[-1, 0].set_xlabel(
        "ms per step, one rank: each thread's time in each phase's ranges; other: the "
        "training thread's rest of the step, another thread's CPU outside its ranges"
    )
    legend: dict[str, Artist] = {}
    for ax in axes[:, 0]:
        for handle, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, handle)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.9 / fig.get_figheight(), 1, 1 - 0.1 / fig.get_figheight()))
    fig.legend(
        list(legend.values()),
        list(legend),
        fontsize=7,
        loc="lower center",
        ncol=4,
        bbox_to_anchor=(0.5, 0.0),
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    """Render the profiles of one or more saved step reports (``commopt bench step --profile
    --json ...``) as one table and one plot: shaped and unshaped side by side."""
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="python -m commopt.bench.profile_report", description=main.__doc__
    )
    parser.add_argument("reports", nargs="+", help="JSON reports of commopt bench step --profile")
    parser.add_argument("--rank", default="0", help="whose profile (default rank 0)")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    parser.add_argument("--plot", metavar="PATH", help="write the stacked-bar PNG")
    parser.add_argument("--only", help="comma-separated configurations (config or model/config)")
    args = parser.parse_args(argv)
    entries = []
    for path in args.reports:
        report = json.loads(Path(path).read_text())
        entries += report_entries(
            report,
            args.rank,
            link_label=len(args.reports) > 1,
            only=args.only.split(",") if args.only else None,
        )
    if not entries:
        raise SystemExit("no profile in these reports: run commopt bench step with --profile")
    print(profile_table(entries))
    if args.markdown:
        Path(args.markdown).write_text(profile_table(entries, markdown=True) + "\n")
    if args.plot:
        plot_profile(entries, args.plot, title=f"rank {args.rank}; " + ", ".join(args.reports))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
