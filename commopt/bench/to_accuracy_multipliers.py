"""``commopt bench to_accuracy --from-json RESULT.json ... --write-multipliers PATH``: the
step multipliers of ``compression="auto"`` (:mod:`commopt.optim.step_multipliers`) from the
benchmark's result files.

A configuration's ratio in one file is its steps to the target over DDP fp32's in that file
(means over the seeds both ran; one that never reached the target counts at the file's
budget factor, a lower bound, and is marked ``censored``). Which entry a configuration
measures: DDP's fp16 and bf16 hooks and PowerSGD with its warm-up (``-warm``), and commopt's
codecs with overlap, measure the codec; commopt's ``-db`` and ``-comp`` configurations measure
the ``stale`` and ``compensated`` schedules, as their ratio to the same codec with overlap in
the same file; a ``local_stepsH`` configuration measures ``local_steps:H`` (of the benchmark's
own, only ``commopt-local-stepsH``: fp32 outer gradients, one fragment, no overlap), and
``commopt-local-stepsH-CODEC`` (one fragment, no overlap) measures the outer-gradient codec
as its ratio to ``commopt-local-stepsH`` in the same file. ``auto``, mixed
plans and DDP PowerSGD without its warm-up measure nothing. Per task, the files' ratios are
averaged weighted by their seeds; an entry's multiplier is the mean over the tasks. Entries
no file measures keep what the table had (an estimate with its source).

    >>> row = {"config": "ddp-fp16", "steps_to_target": 150.0, "seeds_reached": 1,
    ...        "seeds_run": 1, "reached": True}
    >>> base = dict(row, config="ddp-fp32")
    >>> ratios({"task": "text", "rows": [base, row], "budget_factor": 2})
    [('codecs', 'fp16', 'text', 1.0, 1, False)]
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from commopt.optim.step_multipliers import TABLE_PATH, StepMultipliers

_LOCAL = re.compile(r"local[-_]?steps?(\d+)")
_SCHEDULE_SUFFIX = {"-db": "stale", "-comp": "compensated"}


def _codec_of(name: str) -> str | None:
    """The codec a configuration's name measures with the synchronous schedule (or None)."""
    from commopt.bench.step.configs import CONFIGS

    cfg = CONFIGS.get(name)
    if cfg is None or cfg.mixed or cfg.double_buffering or cfg.wire in ("fp32", "auto"):
        return None
    if cfg.wire == "powersgd":
        if cfg.kind == "ddp" and not cfg.powersgd_warmup:
            return None
        return f"powersgd{cfg.powersgd_rank}"
    return cfg.wire


def _plain_local_steps(name: str) -> bool:
    """Whether ``name`` measures the local-steps schedule alone: commopt's, fp32 outer
    gradients, one fragment, no overlap (names the benchmark does not know: by the name)."""
    from commopt.bench.step.configs import CONFIGS

    cfg = CONFIGS.get(name)
    if cfg is None:
        return True
    return (
        cfg.kind == "commopt"
        and cfg.wire == "fp32"
        and cfg.fragments == 1
        and not cfg.overlap_steps
    )


def _outer_codec_of(name: str) -> str | None:
    """The codec of local steps' outer gradients that ``name`` measures against exact ones at
    the same H (commopt's, one fragment, no overlap), or None."""
    from commopt.bench.step.configs import CONFIGS

    cfg = CONFIGS.get(name)
    if (
        cfg is None
        or cfg.kind != "commopt"
        or cfg.fragments != 1
        or cfg.overlap_steps
        or cfg.wire in ("fp32", "auto")
    ):
        return None
    return cfg.wire


def _steps(row: dict) -> float | None:
    if row.get("reached") and row.get("steps_to_target"):
        return float(row["steps_to_target"])
    return None


def ratios(report: dict) -> list[tuple[str, str, str, float, int, bool]]:
    """(section, entry, task, ratio, seeds, censored) for every configuration of ``report``
    (a result file's JSON, with its ``rows``) that measures an entry."""
    if not report.get("rows"):
        from commopt.bench.to_accuracy_report import summarize

        report = dict(report, rows=summarize(report))
    rows = {r["config"]: r for r in report["rows"]}
    base = rows.get("ddp-fp32")
    if base is None or _steps(base) is None:
        return []
    task = str(report.get("task") or "?")
    factor = float(report.get("budget_factor") or 1.0)
    out = []

    def ratio(row: dict, ref: dict) -> tuple[float, bool] | None:
        ref_steps = _steps(ref)
        if ref_steps is None:
            return None
        steps = _steps(row)
        if steps is not None:
            return steps / ref_steps, False
        if int(row.get("seeds_run") or 0) and not int(row.get("seeds_reached") or 0):
            return factor * float(base["steps_to_target"]) / ref_steps, True
        return None  # reached on some seeds only: no mean over the same seeds

    for name, row in rows.items():
        seeds = int(row.get("seeds_run") or row.get("seeds_reached") or 1)
        local = _LOCAL.search(name)
        if local and not _plain_local_steps(name):
            outer, plain = _outer_codec_of(name), f"commopt-local-steps{local.group(1)}"
            found = ratio(row, rows[plain]) if outer and plain in rows else None
            if found:
                out.append(("outer_codecs", str(outer), task, found[0], seeds, found[1]))
            continue  # streaming local steps, torchft: no entry of their own
        if local:
            found = ratio(row, base)
            if found:
                out.append(
                    (
                        "schedules",
                        f"local_steps:{local.group(1)}",
                        task,
                        *found[:1],
                        seeds,
                        found[1],
                    )
                )
            continue
        codec = _codec_of(name)
        if codec is not None:
            found = ratio(row, base)
            if found:
                out.append(("codecs", codec, task, found[0], seeds, found[1]))
            continue
        for suffix, schedule in _SCHEDULE_SUFFIX.items():
            if name.endswith(suffix) and name[: -len(suffix)] in rows:
                stem = name[: -len(suffix)]
                if _codec_of(stem) is None:
                    continue
                found = ratio(row, rows[stem])
                if found:
                    out.append(("schedules", schedule, task, found[0], seeds, found[1]))
    return out


def build_table(paths: list[str], previous: dict[str, Any]) -> dict[str, Any]:
    """The table from the result files at ``paths`` (``PATH#CONFIG,...`` takes only those
    configurations' runs), keeping ``previous``'s entries that no file measures."""
    from commopt.bench.to_accuracy_report import read_report

    pooled: dict[tuple[str, str], dict[str, list[tuple[float, int]]]] = {}
    sources: dict[tuple[str, str], list[str]] = {}
    censored: dict[tuple[str, str], set[str]] = {}
    for spec in paths:
        report = read_report(spec)
        if "#" in spec:
            report = {k: v for k, v in report.items() if k != "rows"}
        for section, entry, task, value, seeds, cens in ratios(report):
            key = (section, entry)
            pooled.setdefault(key, {}).setdefault(task, []).append((value, seeds))
            sources.setdefault(key, []).append(spec.partition("#")[0])
            if cens:
                censored.setdefault(key, set()).add(task)
    table = {
        "about": previous.get("about", ""),
        "codecs": dict(previous.get("codecs", {})),
        "schedules": dict(previous.get("schedules", {})),
        "outer_codecs": dict(previous.get("outer_codecs", {})),
    }
    for (section, entry), by_task in sorted(pooled.items()):
        per_task = {
            task: round(sum(v * s for v, s in vals) / sum(s for _, s in vals), 4)
            for task, vals in sorted(by_task.items())
        }
        measured: dict[str, Any] = {
            "multiplier": round(sum(per_task.values()) / len(per_task), 4),
            "measured": per_task,
            "source": "measured: " + ", ".join(sorted(set(sources[(section, entry)]))),
        }
        if (section, entry) in censored:
            measured["censored"] = sorted(censored[(section, entry)])
        table[section][entry] = measured
    return table


def write_multipliers(paths: list[str], out: str | Path | None = None) -> dict[str, Any]:
    """Rewrite the table at ``out`` (default: the package's) from ``paths``; checked by
    loading it back. Returns the table."""
    out = Path(out) if out is not None else TABLE_PATH
    previous = json.loads(out.read_text()) if out.exists() else (json.loads(TABLE_PATH.read_text()))
    table = build_table(paths, previous)
    StepMultipliers.from_dict(table)  # every multiplier readable and positive
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table
