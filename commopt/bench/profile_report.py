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

#: Columns of the profile table: the phases, the CPU py-spy could not attribute (native
#: threads it does not sample), the thread's CPU and its time asleep.
COLUMNS = (*PHASES, "native")


def thread_rows(profile: dict) -> dict[str, dict[str, float]]:
    """One rank's profile -> role -> {phase or "native": CPU ms per step, "cpu", "blocked",
    "switches", "preempted" per step}; roles sorted training first.

    A thread's CPU (its clock) is split over phases by its running samples; a thread py-spy
    did not sample (gloo's, OpenMP's, autograd's native threads) counts as "native". Blocked
    ms: the thread's samples asleep in a wait, at the sampling's actual spacing (the window
    over the training thread's sample count).
    """
    steps = profile["steps"]
    threads = list(profile["threads"].values())
    main = [t for t in threads if t["role"] == "training"]
    main_samples = sum(sum(t["samples"].values()) + sum(t["blocked"].values()) for t in main)
    spacing_ms = 1e3 * profile["wall_s"] / main_samples if main_samples else 1e3 / profile["rate"]
    rows: dict[str, dict[str, float]] = {}
    for t in threads:
        row = rows.setdefault(t["role"], {})
        cpu_ms = 1e3 * t["cpu_s"] / steps
        running = sum(t["samples"].values())
        if running:
            for phase, n in t["samples"].items():
                row[phase] = row.get(phase, 0.0) + cpu_ms * n / running
        else:
            row["native"] = row.get("native", 0.0) + cpu_ms
        row["cpu"] = row.get("cpu", 0.0) + cpu_ms
        row["blocked"] = row.get("blocked", 0.0) + spacing_ms * sum(t["blocked"].values()) / steps
        row["switches"] = row.get("switches", 0.0) + t.get("switches", 0) / steps
        row["preempted"] = row.get("preempted", 0.0) + t.get("preempted", 0) / steps
    if "training" in rows:  # the rest of its wall time: runnable without a core, or paused
        row = rows["training"]
        row["queued"] = max(0.0, 1e3 * profile["wall_s"] / steps - row["cpu"] - row["blocked"])
    order = [
        "training",
        "collectives driver",
        "MPI worker",
        "gloo transport",
        "autograd",
        "other threads",
    ]
    return {k: rows[k] for k in sorted(rows, key=lambda r: order.index(r) if r in order else 99)}


def profile_table(entries: list[tuple[str, dict, dict]], markdown: bool = False) -> str:
    """A table of ms per step: for each (label, rank's profile, row figures) its threads by
    phase and all threads together; under it, each step beside its floor. The training
    thread's CPU, time asleep and time without a core (runnable but not running, or paused
    by py-spy) add up to the profiled step.

        >>> prof = {
        ...     "steps": 2,
        ...     "rate": 100,
        ...     "wall_s": 0.2,
        ...     "threads": {
        ...         "1": {
        ...             "role": "training",
        ...             "cpu_s": 0.1,
        ...             "samples": {"backward": 3, "pack": 1},
        ...             "blocked": {"wait/poll": 16},
        ...             "switches": 4,
        ...             "preempted": 2,
        ...         }
        ...     },
        ... }
        >>> text = profile_table([("x", prof, {"step_s": 0.1, "floor_s": 0.05})], markdown=True)
        >>> [c.strip() for c in text.splitlines()[2].split("|")[1:5]]
        ['x: training', '-', '38', '12']
        >>> text.splitlines()[-1]
        'x: profiled steps 100 ms on average; timed step 100 ms; floor 50 ms (timed step / floor 2.00x)'
    """
    from commopt._tables import table

    head = ("thread", *COLUMNS, "CPU", "asleep", "no core", "switches", "preempted")
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
                    fmt(row["blocked"]),
                    fmt(row.get("queued")) if role == "training" else "",
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
                "",
                fmt(total.get("switches")),
                fmt(total.get("preempted")),
            ]
        )
        note = [f"profiled steps {1e3 * prof['wall_s'] / prof['steps']:.0f} ms on average"]
        if fig.get("step_s"):
            note.append(f"timed step {fig['step_s'] * 1e3:.0f} ms")
            if fig.get("floor_s"):
                note.append(
                    f"floor {fig['floor_s'] * 1e3:.0f} ms (timed step / floor "
                    f"{fig['step_s'] / fig['floor_s']:.2f}x)"
                )
        notes.append(f"{label}: " + "; ".join(note))
    return "\n".join([table(head, lines, markdown=markdown), "", *notes])


#: One colour per phase (and for the time asleep) in the stacked bars.
_COLOURS = {
    "forward": "#a6cee3",
    "backward": "#1f78b4",
    "pack": "#b2df8a",
    "NaN check": "#33a02c",
    "encode": "#fb9a99",
    "send/receive": "#e31a1c",
    "wait/poll": "#fdbf6f",
    "decode": "#ff7f00",
    "unpack": "#cab2d6",
    "apply": "#6a3d9a",
    "commopt Python": "#ffff99",
    "other": "#b15928",
    "native": "#999999",
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


def reattribute(report: dict, workdir: str) -> int:
    """Classify again the raw py-spy samples a run kept in its ``--workdir`` (after a change of
    :data:`~commopt.bench.profile_step.PHASE_RULES`), keeping each thread's measured CPU.
    Returns how many profiles were redone."""
    from commopt.bench.profile_step import attribute, parse_raw

    done = 0
    for model, info in report["models"].items():
        for config, raw in info.get("raw", {}).items():
            for rank, prof in (raw.get("profile") or {}).items():
                found = sorted(Path(workdir).glob(f"{model}-*.json.{config}.rank{rank}.pyspy.txt"))
                if not found:
                    continue
                cpu = {
                    int(tid): (
                        t["os_name"],
                        t["cpu_s"],
                        t.get("switches", 0),
                        t.get("preempted", 0),
                    )
                    for tid, t in prof["threads"].items()
                    if t["os_name"]
                }
                threads = attribute(parse_raw(found[-1].read_text(errors="replace")), cpu)
                prof["threads"] = {str(tid): t for tid, t in threads.items()}
                done += 1
    return done


def plot_profile(entries: list[tuple[str, dict, dict]], path: str, title: str = "") -> None:
    """Stacked bars: each thread's CPU ms per step by phase and its time asleep, per profiled
    configuration, with the timed step and its floor marked."""
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
            if role == "training":  # the rest of the profiled step's wall time
                for key, hatch, lab in (
                    ("blocked", "///", "asleep (waiting)"),
                    ("queued", "...", "runnable, no core free (or paused by py-spy)"),
                ):
                    if rows[role].get(key):
                        ax.barh(
                            y,
                            rows[role][key],
                            left=left,
                            color="white",
                            edgecolor="#777777",
                            hatch=hatch,
                            lw=0.5,
                            label=lab,
                        )
                        left += rows[role][key]
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
            label="profiled step (wall; py-spy pauses the process per sample)",
        )
        right = max(right, profiled)
        ax.set_title(label, fontsize=9, loc="left")
    for ax in axes[:, 0]:
        ax.set_xlim(0, right * 1.05)
    axes[-1, 0].set_xlabel(
        "ms per step, one rank: each thread's CPU by phase (solid); the training "
        "thread's time asleep and runnable without a core (hatched)"
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
    parser.add_argument(
        "--samples",
        metavar="WORKDIR",
        nargs="+",
        help="one --workdir per report: classify its kept py-spy samples again "
        "and write the report back (its measured times stay as they were)",
    )
    args = parser.parse_args(argv)
    if args.samples and len(args.samples) != len(args.reports):
        parser.error("give one --samples folder per report, in the same order")
    entries = []
    for k, path in enumerate(args.reports):
        report = json.loads(Path(path).read_text())
        if args.samples:
            redone = reattribute(report, args.samples[k])
            Path(path).write_text(json.dumps(report, indent=1))
            print(f"{path}: {redone} profile(s) classified again from {args.samples[k]}")
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
