"""Time to accuracy from loss curves: targets, when each configuration reached them, the table.

A curve is a list of ``(step, training wall seconds, validation loss)`` points. Each seed's
target is that seed's reference (DDP fp32) validation loss at the end of the budget, raised
by ``tolerance`` (relative, default 1%: fp32's own curve is still falling there, so an exact
tie would be decided by noise); a configuration reaches it at its first evaluation at or
below. Per configuration and seed: the wall time and steps to the target and the floor, the
steps needed x the configuration's compute-plus-codec seconds per step (the time if the link
cost nothing). Per configuration: their mean and spread over the seeds, and the speed-ups
against DDP fp32 and against the best DDP hook that reaches the target (ratios of the mean
times, where every seed reached it), and the bytes each rank sent to the target (the record's
``sent_bytes`` beside each evaluation: a local-steps configuration sends only on the steps a
fragment synchronises; older records: bytes per step x steps) and how many times fewer than
DDP fp32's. A local-steps configuration's time per step is the mean over its whole cycles of
``sync_every`` steps (a median would report only its silent steps).

    >>> reached([(0, 0.0, 4.6), (10, 5.0, 3.0), (20, 10.0, 2.5)], 2.9)
    (20, 10.0)
    >>> reached([(0, 0.0, 4.6), (10, 5.0, 3.0)], 2.9) is None
    True
    >>> spread([1.0, 2.0, 3.0])
    (2.0, 1.0)
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from commopt.bench.step.configs import CONFIGS, allreduce_limit_s, cycle_mean, step_seconds

REFERENCE = "ddp-fp32"
#: Goals the headline is checked against: the best commopt configuration reaches the target
#: this many times sooner than the best DDP hook and than DDP fp32, within this ratio of its
#: floor; ``auto`` at most this fraction behind the best other configuration.
GOAL_VS_HOOK = 2.0
GOAL_VS_FP32 = 3.0
GOAL_FLOOR_RATIO = 1.3
GOAL_AUTO_BEHIND = 0.05
#: Local steps: bytes on the wire to the target at least this many times fewer than DDP fp32's.
GOAL_BYTES_VS_FP32 = 100.0

#: The least ratio of DDP fp32's median step to its compute-only step that each setting
#: promises (``commopt bench to_accuracy --setting``): the link-bound setting is the regime of
#: GPU clusters whose link is the limit; a run below it is marked, not silently reported.
LINK_BOUND_MIN_RATIO = 8.0
SETTING_MIN_RATIO: dict[str | None, float] = {"link-bound": LINK_BOUND_MIN_RATIO}
#: A time to the target prices its steps at the median of this many repeats of the step-time
#: measurement (consecutive blocks of the run: ``step_repeats``), each of at least
#: MIN_REPEAT_STEPS steps; a repeat more than OUTLIER_FRACTION from their median is reported.
REPEATS = 3
MIN_REPEAT_STEPS = 2
OUTLIER_FRACTION = 0.25


REPEATS_NOTE = (
    f"Wall to target: the steps to the target x the median of {REPEATS} repeats of the step "
    f"time (consecutive blocks of the run; DDP PowerSGD's plain-allreduce warm-up steps at "
    f"their own median; the measured sum is in the result file as measured_wall_s). "
)


def step_ratio_text(step_s: float, compute_s: float, min_ratio: float | None) -> str:
    """One line: DDP fp32's median step against its compute-only step, and, where the
    setting promises a least ratio, whether it holds (loudly when it does not).

        >>> step_ratio_text(2.0, 0.5, 8.0).startswith("WARNING")
        True
        >>> step_ratio_text(4.0, 0.25, 8.0)
        'DDP fp32: median step 4.000 s = 16.0x its compute-only step 0.250 s (the setting needs >= 8x: holds)'
    """
    ratio = step_s / compute_s if compute_s else float("inf")
    text = (
        f"DDP fp32: median step {step_s:.3f} s = {ratio:.1f}x its compute-only step "
        f"{compute_s:.3f} s"
    )
    if min_ratio is None:
        return text
    if ratio >= min_ratio:
        return f"{text} (the setting needs >= {min_ratio:g}x: holds)"
    return (
        f"WARNING: NOT LINK-BOUND: {text}, below the setting's {min_ratio:g}x: this run does "
        f"not measure the link-bound regime (a slower --link or a narrower --hidden raises it)"
    )


def setting_check(report: dict) -> dict | None:
    """DDP fp32's median step (over every seed's steps) against its compute-only step (the
    mean over the seeds), checked against the setting's least ratio: ``{"setting",
    "median_step_s", "compute_s", "ratio", "min_ratio", "met", "text"}``; ``met`` is None
    where the setting promises no ratio. None when DDP fp32 has no timed run."""
    runs = seed_runs(report).get(REFERENCE, {})
    done = [rec for rec in runs.values() if "curve" in rec and rec.get("compute_s")]
    times = sorted(t for rec in done for t in rec.get("step_times", []))
    if not done or not times:
        return None
    step = statistics.median(times)
    compute = statistics.fmean(rec["compute_s"] for rec in done)
    setting = report.get("setting")
    min_ratio = report.get("setting_min_ratio", SETTING_MIN_RATIO.get(setting))
    ratio = step / compute
    return {
        "setting": setting,
        "median_step_s": step,
        "compute_s": compute,
        "ratio": ratio,
        "min_ratio": min_ratio,
        "met": None if min_ratio is None else ratio >= min_ratio,
        "text": step_ratio_text(step, compute, min_ratio),
    }


def reached(curve, target: float):
    """(steps, wall seconds) of the first point of ``curve`` at or below ``target``; else None."""
    for step, wall, loss in curve:
        if loss <= target:
            return step, wall
    return None


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def seed_runs(report: dict) -> dict[str, dict[str, dict]]:
    """config -> seed (text) -> that run's record (a curve, or an error).

    Reports written before ``--seeds`` hold one record per configuration: read as the
    report's one seed.
    """
    out: dict[str, dict[str, dict]] = {}
    for name, run in report["runs"].items():
        if "seeds" in run:
            out[name] = run["seeds"]
        else:
            out[name] = {str(report.get("seed", 0)): run}
    return out


def _losses(rec: dict) -> list | None:
    return [point[2] for point in rec["curve"]] if "curve" in rec else None


def read_report(spec: str) -> dict:
    """A saved report, ``PATH`` or ``PATH#CONFIG,CONFIG``: the configurations named after
    ``#`` only (to merge a file's other runs, say, without its runs of a configuration that a
    later command measured again after a change). A named configuration the file lacks
    raises."""
    path, _, names = spec.partition("#")
    report = json.loads(Path(path).read_text())
    if not names:
        return report
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    runs = seed_runs(report)
    missing = [n for n in wanted if n not in runs]
    if missing:
        raise ValueError(f"{path} has no runs of {missing}; it has {sorted(runs)}")
    kept = {k: v for k, v in report.items() if k not in ("rows", "headline", "rendered_by")}
    kept["runs"] = {n: {"seeds": runs[n]} for n in wanted}
    return kept


def merge_reports(reports: list[dict]) -> dict:
    """One report from reports of the same task and setting run by separate commands: the
    union of their runs, their commands and seeds. A configuration's seed in more than one
    report must be the same training run (the runs are deterministic: every command that
    adds configurations runs DDP fp32 again for its target): the first report's is kept, and
    different losses raise. One report is returned as it is."""
    if len(reports) == 1:
        return reports[0]
    first = reports[0]
    same = ("task", "nprocs", "rate_bits", "budget", "tolerance", "eval_every", "batch_per_rank")
    for other in reports[1:]:
        differ = [k for k in same if other.get(k) != first.get(k)]
        if differ:
            raise ValueError(
                f"cannot merge time-to-accuracy reports whose {', '.join(differ)} differ "
                f"({[first.get(k) for k in differ]} vs {[other.get(k) for k in differ]}): "
                "merge runs of one task and setting only"
            )
    merged = {k: v for k, v in first.items() if k not in ("rows", "headline", "rendered_by")}
    merged["runs"] = {}
    for rep in reports:
        for name, by_seed in seed_runs(rep).items():
            mine = merged["runs"].setdefault(name, {"seeds": {}})["seeds"]
            for seed, rec in by_seed.items():
                if seed in mine:
                    if _losses(mine[seed]) is not None and _losses(mine[seed]) == _losses(rec):
                        continue  # the same training run again (DDP fp32, the target): first kept
                    raise ValueError(
                        f"{name} seed {seed} is in more than one report with other losses: "
                        "keep one of them"
                    )
                mine[seed] = rec
    merged["command"] = " ; ".join(rep["command"] for rep in reports)
    merged["seeds"] = sorted({int(s) for rep in reports for s in rep.get("seeds", [])})
    merged["date"] = " and ".join(dict.fromkeys(rep["date"] for rep in reports))
    merged["load_average_start"] = max(rep["load_average_start"] for rep in reports)
    merged["budget_factor"] = min(rep.get("budget_factor") or 1.0 for rep in reports)
    return merged


def targets(report: dict) -> dict[str, float]:
    """seed -> DDP fp32's loss at the budget x (1 + the report's ``tolerance``)."""
    runs = seed_runs(report)
    ref = runs.get(REFERENCE)
    if ref is None:
        raise ValueError(f"the target is {REFERENCE}'s final loss: run {REFERENCE} too")
    tol = report.get("tolerance", 0.0)
    out = {}
    for seed, rec in ref.items():
        if "curve" not in rec:
            raise ValueError(
                f"{REFERENCE} (the target) did not finish, seed {seed}: {rec.get('error')}"
            )
        out[seed] = rec["curve"][-1][2] * (1 + tol)
    return out


def target_loss(report: dict) -> float:
    """The mean over the seeds of the targets (one seed: its target)."""
    return statistics.fmean(targets(report).values())


def bytes_to(rec: dict, step: int) -> float:
    """Bytes one rank sent by the end of ``step``: the record's ``sent_bytes`` at that
    evaluation, else (records without it) bytes per step x steps."""
    sent = rec.get("sent_bytes")
    if sent:
        for point, nbytes in zip(rec["curve"], sent):
            if point[0] == step:
                return float(nbytes)
    return float(rec["wire_bytes"]) * step


def outliers(repeats: list[float], mid: float) -> list[int]:
    """The repeats more than OUTLIER_FRACTION away from ``mid``, their median.

    >>> outliers([0.5, 0.5, 2.0], 0.5)
    [2]
    """
    return [i for i, m in enumerate(repeats) if abs(m - mid) > OUTLIER_FRACTION * mid]


def step_repeats(step_times: list[float], steps: int, skip: int = 0, cycle: int = 1) -> dict:
    """The step-time part of a time to the target, from repeats of its measurement.

    The first ``skip`` steps (DDP PowerSGD's plain-allreduce warm-up) are priced at their own
    median step. The other steps up to ``steps`` are cut into REPEATS consecutive blocks,
    each a repeat of the step-time measurement, and priced at the median over the blocks of
    each block's median step: a disturbed block (another process on the shared cores) moves
    neither the figure nor, unless two of three are, its median. A block whose median is more
    than OUTLIER_FRACTION away from that median is reported as an outlier. With fewer than
    REPEATS x MIN_REPEAT_STEPS such steps, the figure is the measured sum, and ``why_not``
    says so. A configuration that synchronises every ``cycle`` steps (local steps) is cut at
    whole cycles and each block priced at its mean (a median would see only the silent
    steps); with fewer than REPEATS whole cycles, the measured sum.

        >>> r = step_repeats([0.5] * 8 + [2.0] * 4, 12)
        >>> r["repeats"], r["median_step_s"], r["time_s"], r["outliers"]
        ([0.5, 0.5, 2.0], 0.5, 6.0, [2])
        >>> r = step_repeats([0.1, 0.1, 0.1, 0.5] * 3, 12, cycle=4)  # local steps, H = 4
        >>> r["repeats"], round(r["time_s"], 6)
        ([0.2, 0.2, 0.2], 2.4)
        >>> step_repeats([0.3, 0.2], 2)["why_not"]
        'only 2 steps to the target: too few for 3 repeats, the measured sum'
    """
    times = list(step_times[:steps])
    skip = min(max(skip, 0), len(times))
    head, rest = times[:skip], times[skip:]
    head_s = len(head) * statistics.median(head) if head else 0.0
    # local steps: whole cycles, each block at its mean; else steps, each block at its median
    unit, aggregate = (cycle, statistics.fmean) if cycle > 1 else (1, statistics.median)
    units = len(rest) // unit
    if units < (REPEATS if cycle > 1 else REPEATS * MIN_REPEAT_STEPS):
        what = f"{units} whole cycles of {cycle} steps" if cycle > 1 else f"{len(rest)} steps"
        whole = cycle_mean(rest, cycle) if cycle > 1 else None
        return {
            "repeats": [],
            "median_step_s": whole if cycle > 1 else statistics.median(rest) if rest else None,
            "time_s": sum(times),
            "outliers": [],
            "why_not": f"only {what} to the target: too few for {REPEATS} repeats, the "
            "measured sum",
        }
    cuts = [round(i * units / REPEATS) * unit for i in range(REPEATS + 1)]
    blocks = [aggregate(rest[a:b]) for a, b in itertools.pairwise(cuts)]
    mid = statistics.median(blocks)
    return {
        "repeats": blocks,
        "median_step_s": mid,
        "time_s": head_s + len(rest) * mid,
        "outliers": outliers(blocks, mid),
        "why_not": None,
    }


def _seed_row(rec: dict, target: float, cycle: int = 1) -> dict:
    hit = reached(rec["curve"], target)
    step_cost = (
        rec["compute_s"] + (rec.get("codec_s") or 0.0) if rec.get("compute_s") is not None else None
    )
    rep = (
        step_repeats(rec["step_times"], hit[0], rec.get("powersgd_start_iter", 0), cycle)
        if hit and rec.get("step_times")
        else None
    )
    out = {
        "reached": hit is not None,
        "steps_to_target": hit[0] if hit else None,
        "wall_to_target_s": (rep["time_s"] if rep else hit[1]) if hit else None,
        "measured_wall_s": hit[1] if hit else None,
        "repeats": rep,
        "final_loss": rec["curve"][-1][2],
        "floor_s": hit[0] * step_cost if hit and step_cost is not None else None,
        "bytes_to_target": bytes_to(rec, hit[0]) if hit else None,
    }
    # A run stopped at a higher target than this one cannot tell whether it would reach it.
    stop = rec.get("stop_target")
    out["undecided"] = (
        hit is None and rec.get("stopped") == "target" and stop is not None and target < stop
    )
    if out["floor_s"]:
        out["floor_ratio"] = out["wall_to_target_s"] / out["floor_s"]
    return out


def summarize(report: dict) -> list[dict]:
    """One row per configuration: time and steps to the target (mean and spread over the
    seeds), speed-ups, the floor, final loss, the link's limit."""
    runs = seed_runs(report)
    goal = targets(report)
    rows: list[dict[str, Any]] = []
    for name, by_seed in runs.items():
        label = CONFIGS[name].label if name in CONFIGS else name
        errors = [rec["error"] for s, rec in by_seed.items() if s in goal and "curve" not in rec]
        done = {s: rec for s, rec in by_seed.items() if s in goal and "curve" in rec}
        if not done:
            rows.append(
                {"config": name, "label": label, "error": errors[0] if errors else "did not run"}
            )
            continue
        cfg = CONFIGS.get(name)
        cycle = cfg.cycle if cfg is not None else 1
        per = {s: _seed_row(rec, goal[s], cycle) for s, rec in done.items()}
        hits = [p for p in per.values() if p["reached"]]
        # (each seed's whole cycles: a seed's cut-off tail does not shift the next seed's)
        all_times = [
            t
            for rec in done.values()
            for t in rec["step_times"][: len(rec["step_times"]) // cycle * cycle]
        ]
        any_rec = next(iter(done.values()))
        compute = [rec["compute_s"] for rec in done.values() if rec.get("compute_s") is not None]
        codec = [rec["codec_s"] for rec in done.values() if rec.get("codec_s") is not None]
        row: dict[str, Any] = {
            "config": name,
            "label": label,
            "kind": CONFIGS[name].kind if name in CONFIGS else name.split("-")[0],
            "target": statistics.fmean(goal[s] for s in done),
            "seeds": {s: per[s] for s in done},
            "seeds_run": len(done),
            "seeds_reached": len(hits),
            "errors": errors,
            "reached": len(hits) == len(done) and not errors,
            "undecided": any(p["undecided"] for p in per.values()),
            "final_loss": statistics.fmean(p["final_loss"] for p in per.values()),
            "median_step_s": step_seconds(CONFIGS.get(name), all_times),
            "cycle_steps": cycle,
            "wire_mb": any_rec["wire_bytes"] / 1e6,
            "link_limit_step_s": allreduce_limit_s(
                any_rec["wire_bytes"], report["nprocs"], report.get("rate_bits")
            ),
            "compute_s": statistics.fmean(compute) if compute else None,
            "codec_s": statistics.fmean(codec) if codec else None,
            "wall_to_target_s": None,
            "steps_to_target": None,
        }
        row["outlier_repeats"] = [
            f"seed {s}: repeat {i + 1} of {len(p['repeats']['repeats'])} "
            f"{p['repeats']['repeats'][i]:.3f} s/step against their median "
            f"{p['repeats']['median_step_s']:.3f} s"
            for s, p in per.items()
            if p.get("repeats")
            for i in p["repeats"]["outliers"]
        ]
        row["outlier_compute"] = [
            f"seed {s}: repeat {i + 1} of {len(reps)} {reps[i] * 1e3:.1f} ms/step against their "
            f"median {rec['compute_s'] * 1e3:.1f} ms"
            for s, rec in done.items()
            for reps in [rec.get("compute_repeats")]
            if reps
            for i in outliers(reps, rec["compute_s"])
        ]
        row["repeats_why_not"] = [
            f"seed {s}: {p['repeats']['why_not']}"
            for s, p in per.items()
            if p.get("repeats") and p["repeats"]["why_not"]
        ]
        if hits:  # the mean over the seeds that reached it (all of them where ``reached``)
            row["wall_to_target_s"], row["wall_to_target_sd"] = spread(
                [p["wall_to_target_s"] for p in hits]
            )
            row["steps_to_target"], row["steps_to_target_sd"] = spread(
                [p["steps_to_target"] for p in hits]
            )
            row["bytes_to_target"], row["bytes_to_target_sd"] = spread(
                [p["bytes_to_target"] for p in hits]
            )
            floors = [p["floor_s"] for p in hits if p["floor_s"]]
            if len(floors) == len(hits):
                row["floor_s"] = statistics.fmean(floors)
                row["floor_ratio"], row["floor_ratio_sd"] = spread([p["floor_ratio"] for p in hits])
        rows.append(row)
    ref = next((r for r in rows if r["config"] == REFERENCE), None)
    for r in rows:
        if not r.get("reached") or not r.get("wall_to_target_s"):
            continue
        if ref is not None and ref.get("reached"):
            r["speedup_vs_ddp_fp32"] = _ratio(ref, r)
            r["bytes_fewer_than_ddp_fp32"] = _ratio(ref, r, "bytes_to_target")
        hook = best_hook(rows, list(r["seeds"]))
        if hook is not None:
            r["speedup_vs_best_hook"] = _ratio(hook, r)
            r["best_hook"] = hook["config"]
    return rows


def _mean_wall(row: dict, seeds: list[str], key: str = "wall_to_target_s") -> float | None:
    """``row``'s mean wall time (or ``key``) to the target over ``seeds`` (None: not run on
    all of them)."""
    per = row.get("seeds", {})
    if not all(s in per and per[s].get(key) for s in seeds):
        return None
    return statistics.fmean(per[s][key] for s in seeds)


def _ratio(base: dict, row: dict, key: str = "wall_to_target_s") -> float | None:
    """``base``'s mean time (or ``key``) over ``row``'s, on the seeds ``row`` ran (both
    reached them)."""
    seeds = list(row["seeds"])
    a, b = _mean_wall(base, seeds, key), _mean_wall(row, seeds, key)
    return a / b if a is not None and b else None


def best_hook(rows: list[dict], seeds: list[str]) -> dict | None:
    """The DDP configuration other than fp32, run on all of ``seeds`` and reaching the target
    on every seed it ran, with the lowest mean time over ``seeds``."""
    hooks = [
        r for r in rows if r.get("kind") == "ddp" and r["config"] != REFERENCE and r.get("reached")
    ]
    timed = [(w, r) for r in hooks if (w := _mean_wall(r, seeds)) is not None]
    return min(timed, key=lambda wr: wr[0], default=(None, None))[1]


def headline(rows: list[dict]) -> dict | None:
    """The best commopt configuration against the goals; None when none reached the target.

    The headline is chosen among the commopt configurations run on the most seeds (where
    runs of several commands are merged, those of the headline's command). ``auto`` (any
    ``commopt-auto*``) against the best other configuration of any kind, on the seeds both ran.
    """
    ok = [r for r in rows if r.get("reached") and r.get("wall_to_target_s")]
    ours = [r for r in ok if r.get("kind") == "commopt"]
    most = max((r["seeds_run"] for r in ours), default=0)
    best = min(
        (r for r in ours if r["seeds_run"] == most),
        key=lambda r: r["wall_to_target_s"],
        default=None,
    )
    if best is None:
        return None
    hook = best_hook(rows, list(best["seeds"]))
    out: dict = {
        "config": best["config"],
        "label": best["label"],
        "seeds": best["seeds_run"],
        "wall_to_target_s": best["wall_to_target_s"],
        "vs_ddp_fp32": best.get("speedup_vs_ddp_fp32"),
        "vs_best_hook": best.get("speedup_vs_best_hook"),
        "best_hook": hook["config"] if hook else None,
        "floor_ratio": best.get("floor_ratio"),
    }
    out["met_vs_ddp_fp32"] = out["vs_ddp_fp32"] is not None and out["vs_ddp_fp32"] >= GOAL_VS_FP32
    out["met_vs_best_hook"] = hook is None or (
        out["vs_best_hook"] is not None and out["vs_best_hook"] >= GOAL_VS_HOOK
    )
    out["met_floor"] = out["floor_ratio"] is not None and out["floor_ratio"] <= GOAL_FLOOR_RATIO
    autos = [r for r in rows if r["config"].startswith("commopt-auto")]
    if autos:
        seeds = list(best["seeds"])
        timed = [
            (w, r)
            for r in ok
            if not r["config"].startswith("commopt-auto") and (w := _mean_wall(r, seeds))
        ]
        reached_autos = [
            (w, r) for r in autos if r.get("reached") and (w := _mean_wall(r, seeds)) is not None
        ]
        if timed:
            other_w, best_other = min(timed, key=lambda wr: wr[0])
            auto_w, best_auto = min(reached_autos, key=lambda wr: wr[0], default=(None, None))
            out["auto"] = {
                "config": best_auto["config"] if best_auto else None,
                "best_other": best_other["config"],
                "seeds": len(seeds),
                "behind": auto_w / other_w - 1 if auto_w is not None else None,
            }
            out["auto"]["met"] = (
                out["auto"]["behind"] is not None and out["auto"]["behind"] <= GOAL_AUTO_BEHIND
            )
    return out


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean_sd(row: dict, key: str, sd_key: str, spec: str, single: str) -> str:
    """``mean ± sd`` with several seeds, the value alone (as ``single``) with one."""
    value = row.get(key)
    if value is None:
        return "-"
    if row.get("seeds_run", 1) > 1:
        return f"{value:{spec}} ± {row.get(sd_key, 0.0):{spec}}"
    return format(value, single)


def _reached(row: dict) -> str:
    if row.get("seeds_run", 1) > 1:
        text = f"{row['seeds_reached']}/{row['seeds_run']}"
    else:
        text = "yes" if row["reached"] else "no"
    return text + (" (stopped at a higher target)" if row.get("undecided") else "")


def markdown(report: dict, rows: list[dict]) -> str:
    """The table of ``rows`` as markdown, with the command, the setting and the headline."""
    goal = targets(report)
    seeds = list(goal)
    again = f" (table: `{report['rendered_by']}`)" if report.get("rendered_by") else ""
    per_seed = ", ".join(f"seed {s}: {t:.4f}" for s, t in goal.items())
    budget = report["budget"]
    factor = report.get("budget_factor")
    others = (
        f"; the other configurations up to {factor:g}x as many steps, each stopping at its "
        f"first evaluation at or below the target"
        if factor
        else ""
    )
    warm = report.get("powersgd_warmup")
    warm_text = (
        f"; `-warm` PowerSGD: plain allreduce for the first {100 * warm:g}% of the budget"
        if warm is not None
        else ""
    )
    head = (
        f"Command: `{report['command']}`{again}  \n{report['nprocs']} ranks, {report['link']}; "
        f"task {report.get('task', 'text')}: {report['model']}; seeds "
        f"{', '.join(seeds)}; DDP fp32 trains {budget} steps{others}{warm_text}; evaluation "
        f"every {report['eval_every']}; "
        + (
            f"local steps' outer learning rate {report['outer_lr']:g}; "
            if report.get("outer_lr") is not None
            else ""
        )
        + f"target = {REFERENCE}'s validation loss at the budget "
        f"+ {100 * report.get('tolerance', 0):g}% ({per_seed}); {report['machine']}, load "
        f"average {report['load_average_start']:.1f} at the start; {report['date']}.\n\n"
    )
    check = report.get("setting_check") or setting_check(report)
    if check is not None:
        head += f"Setting: {check['setting'] or 'compute-heavy'}. {check['text']}.\n\n"
    many = len(seeds) > 1
    note = (
        f"{REPEATS_NOTE}"
        "Times and steps: mean ± sample standard deviation over the seeds that reached the "
        "target; speed-ups: ratios of the mean times, where every seed reached it; floor: "
        "steps to the target x (compute + codec seconds per step, measured after the "
        "configuration in the same run).\n\n"
        if many
        else f"{REPEATS_NOTE}"
        "Floor: steps to the target x (compute + codec seconds per step, measured after "
        "the configuration in the same run).\n\n"
    )
    if any(r.get("cycle_steps", 1) > 1 for r in rows):
        note += (
            "Local steps (steps are inner steps): the step time and the wire bytes per step "
            "are means over whole synchronisation cycles of H steps (most steps send nothing; "
            "a median would show only those); MB to target: the bytes one rank sent up to the "
            "evaluation that reached the target, counted on the steps that sent them; x fewer "
            "bytes: DDP fp32's MB to target over the configuration's, same seeds.\n\n"
        )
    lines = [
        "| configuration | reached | wall to target (s) | steps to target | x DDP fp32 | "
        "final loss | x best DDP hook | floor (s) | x floor | step (s): median; local steps: "
        "cycle mean | compute + codec/step (s) | wire MB/step (local steps: cycle mean) | "
        "link limit/step (s) | MB to target | x fewer bytes than DDP fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} |" + " |" * 13)
            continue
        to_target = r.get("bytes_to_target")
        step_cost = (
            r["compute_s"] + (r["codec_s"] or 0.0) if r.get("compute_s") is not None else None
        )
        lines.append(
            f"| {r['label']} | {_reached(r)} | "
            f"{_mean_sd(r, 'wall_to_target_s', 'wall_to_target_sd', '.1f', '.1f')} | "
            f"{_mean_sd(r, 'steps_to_target', 'steps_to_target_sd', '.1f', '.0f')} | {_f(r.get('speedup_vs_ddp_fp32'), '.2f')} | "
            f"{r['final_loss']:.4f} | {_f(r.get('speedup_vs_best_hook'), '.2f')} | "
            f"{_f(r.get('floor_s'), '.1f')} | {_f(r.get('floor_ratio'), '.2f')} | "
            f"{_f(r['median_step_s'], '.3f')} | {_f(step_cost, '.3f')} | {r['wire_mb']:.3g} | "
            f"{_f(r['link_limit_step_s'], '.3f')} | "
            f"{_f(None if to_target is None else to_target / 1e6, '.1f')} | "
            f"{_f(r.get('bytes_fewer_than_ddp_fp32'), '.0f')} |"
        )
    failed = [
        f"{r['label']} seed(s) failed: {'; '.join(sorted(set(r['errors'])))}"
        for r in rows
        if "error" not in r and r.get("errors")
    ]
    failed += [
        f"{r['label']}: outlier repeat of the step time (kept in the median): {o}"
        for r in rows
        for o in r.get("outlier_repeats", [])
    ]
    failed += [
        f"{r['label']}: outlier repeat of the compute-only twin (kept in the median): {o}"
        for r in rows
        for o in r.get("outlier_compute", [])
    ]
    failed += [
        f"{r['label']}: no repeats of the step time, {w}"
        for r in rows
        for w in r.get("repeats_why_not", [])
    ]
    text = head + note + "\n".join(lines) + "\n"
    if failed:
        text += "\n" + "\n".join(f"- {f}" for f in failed) + "\n"
    traffic = _traffic_lines(rows)
    return text + _headline_text(rows) + "".join(f"{line}\n" for line in traffic)


def _headline_text(rows: list[dict]) -> str:
    h = headline(rows)
    if h is None:
        return "\nHeadline: no commopt configuration reached the target on every seed.\n"
    n_seeds = h["seeds"]

    def met(flag: bool) -> str:
        return "met" if flag else "NOT met"

    hook = (
        f"{_f(h['vs_best_hook'], '.2f')}x sooner than the best DDP hook ({h['best_hook']}; "
        f"goal {GOAL_VS_HOOK:g}x: {met(h['met_vs_best_hook'])})"
        if h["best_hook"]
        else "no DDP hook reached the target on every seed"
    )
    floor = (
        f"{h['floor_ratio']:.2f}x its floor (goal at most {GOAL_FLOOR_RATIO:g}x: "
        f"{met(h['met_floor'])})"
        if h["floor_ratio"] is not None
        else "its floor was not measured"
    )
    lines = [
        f"\nHeadline ({n_seeds} seed{'s' if n_seeds > 1 else ''}): {h['label']} reached the "
        f"target first among commopt's configurations, in {h['wall_to_target_s']:.1f} s: "
        f"{_f(h['vs_ddp_fp32'], '.2f')}x sooner than DDP fp32 (goal {GOAL_VS_FP32:g}x: "
        f"{met(h['met_vs_ddp_fp32'])}), {hook}; {floor}.",
    ]
    if "auto" in h:
        a = h["auto"]
        if a["config"] is None:
            lines.append(
                f"auto: no commopt-auto configuration reached the target on every seed (goal: "
                f"at most {100 * GOAL_AUTO_BEHIND:g}% behind {a['best_other']}): NOT met."
            )
        else:
            lines.append(
                f"auto: {a['config']} is {100 * a['behind']:+.1f}% against the best other "
                f"configuration, {a['best_other']}, on the same {a['seeds']} seed(s) (goal at most "
                f"{100 * GOAL_AUTO_BEHIND:g}% behind: {met(a['met'])})."
            )
    lines += [
        f"{r['label']}: reached the target on {r['seeds_reached']} of {r['seeds_run']} seed(s)."
        for r in rows
        if r["config"].endswith("-comp") and "error" not in r
    ]
    return "\n".join(lines) + "\n"


def _traffic_lines(rows: list[dict]) -> list[str]:
    """One line per local-steps configuration: did it reach DDP fp32's target on every seed,
    and how many times fewer bytes it sent to it (goal, for compressed outer gradients:
    GOAL_BYTES_VS_FP32)."""
    out = []
    for r in rows:
        cfg = CONFIGS.get(r["config"])
        if cfg is None or not cfg.local_steps or "error" in r:
            continue
        fewer = r.get("bytes_fewer_than_ddp_fp32")
        if not r.get("reached"):
            out.append(
                f"{r['label']}: reached DDP fp32's target on {r['seeds_reached']} of "
                f"{r['seeds_run']} seed(s) within the budget factor: NOT met."
            )
            continue
        verdict = "met" if fewer is not None and fewer >= GOAL_BYTES_VS_FP32 else "NOT met"
        goal = (
            f" (goal {GOAL_BYTES_VS_FP32:g}x: {verdict})" if cfg.wire != "fp32" else ""
        )  # the goal is the compressed outer gradients'
        out.append(
            f"{r['label']}: reached DDP fp32's target on every seed in "
            f"{r['steps_to_target']:.0f} inner steps (mean), sending {_f(fewer, '.0f')}x fewer "
            f"bytes to it than DDP fp32{goal}."
        )
    return out


def plot(report: dict, path: str) -> None:
    """A PNG of validation loss against training wall time: one colour per configuration, a
    thin line per seed and, with several seeds, a thick line through their mean."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = seed_runs(report)
    fig, ax = plt.subplots(figsize=(10, 6))
    colours = plt.get_cmap("tab20")
    for i, (name, by_seed) in enumerate(runs.items()):
        curves = [rec["curve"] for rec in by_seed.values() if "curve" in rec]
        if not curves:
            continue
        colour = colours((2 * i) % 20 + (2 * i // 20) % 2)  # the dark shades first
        style = "--" if name.startswith("ddp") else "-"
        label = CONFIGS[name].label if name in CONFIGS else name
        many = len(curves) > 1
        for k, curve in enumerate(curves):
            ax.plot(
                [p[1] for p in curve],
                [p[2] for p in curve],
                style,
                color=colour,
                linewidth=0.6 if many else 1.4,
                alpha=0.45 if many else 1.0,
                label=None if many or k else label,
            )
        if many:  # the mean over the seeds at the evaluations they all reached
            length = min(len(c) for c in curves)
            ax.plot(
                [statistics.fmean(c[j][1] for c in curves) for j in range(length)],
                [statistics.fmean(c[j][2] for c in curves) for j in range(length)],
                style,
                color=colour,
                linewidth=1.8,
                label=f"{label} (mean of {len(curves)})",
            )
    target = target_loss(report)
    ax.axhline(target, color="grey", linestyle=":", label=f"target ({target:.3f})")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(
        f"Time to accuracy ({report.get('task', 'text')}, "
        f"{report.get('setting') or 'compute-heavy'} setting), {report['nprocs']} ranks, "
        f"{report['link']}",
        fontsize=9,
    )
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(report: dict, args) -> None:
    if getattr(args, "tolerance", None) is not None:
        report["tolerance"] = args.tolerance
    rows = report["rows"] = summarize(report)
    report["headline"] = headline(rows)
    check = report["setting_check"] = setting_check(report)
    if check is not None and check["met"] is False:
        print(check["text"], file=sys.stderr, flush=True)
    print(markdown(report, rows), flush=True)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(report, indent=1))
    if getattr(args, "markdown", None):
        Path(args.markdown).write_text(markdown(report, rows))
    if getattr(args, "plot", None):
        plot(report, args.plot)
