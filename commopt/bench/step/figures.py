"""The step benchmark's figures from raw timings: medians, efficiency, speed-up, targets.

Pure arithmetic over the workers' records (no torch, no processes):

    >>> efficiency(0.5, 0.25), comm_wait_share(0.5, 0.25)
    (0.5, 0.5)
    >>> robust_step(
    ...     [{"step_times": [1.0, 9.0, 2.0]}, {"step_times": [3.0]}, {"step_times": [60.0]}]
    ... )
    3.0
    >>> robust_step([{"step_times": [0.1, 0.1, 0.1, 0.5]}, {"step_times": [0.2] * 4}], cycle=4)
    0.2
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from commopt.bench.step.configs import CONFIGS, allreduce_limit_s, cycle_mean
from commopt.bench.step.floor import floor_s


def efficiency(step_s: float, compute_s: float) -> float:
    """e = t / (t0 n) with t = n B / step_s and t0 = B / compute_s: compute_s / step_s."""
    return compute_s / step_s


def comm_wait_share(step_s: float, compute_s: float) -> float:
    """Share of a step spent beyond compute-only time (waiting for the network), in [0, 1)."""
    return max(0.0, step_s - compute_s) / step_s


def round_step(times: list[float], cycle: int = 1) -> float:
    """One round's step time: the median; with ``cycle`` > 1 (a configuration that
    synchronises every ``cycle`` steps, most steps silent) the mean over its whole cycles."""
    if cycle > 1:
        mean = cycle_mean(times, cycle)
        if mean is not None:
            return mean
    return statistics.median(times)


def robust_step(rounds: list[dict], key: str = "step_times", cycle: int = 1) -> float | None:
    """Median over rounds of each round's median (``cycle`` > 1: each round's mean over whole
    cycles, :func:`round_step`): one slow round cannot move it far."""
    medians = [round_step(r[key], cycle) for r in rounds if r.get(key)]
    return statistics.median(medians) if medians else None


def cpu_share(rounds: list[dict]) -> float | None:
    """Cores one rank kept busy during its timed steps: CPU seconds / wall seconds, median over
    rounds (None for reports from before the CPU was recorded).

    A mean over the blocks' CPU per step against the mean step time, not the median step: a
    slow step's CPU is counted with its own duration.
    """
    shares = [
        statistics.fmean(r["cpu_per_step"]) / statistics.fmean(r["step_times"])
        for r in rounds
        if r.get("cpu_per_step") and r.get("step_times")
    ]
    return statistics.median(shares) if shares else None


@dataclass
class Row:
    """One configuration's measured and derived figures."""

    config: str
    label: str
    kind: str
    step_s: float | None = None
    step_rounds: list[float] | None = None  # each round's median step time
    compute_s: float | None = None
    samples_per_s: float | None = None
    speedup: float | None = None
    efficiency: float | None = None
    comm_wait: float | None = None
    limit_s: float | None = None
    wire_bytes: int | None = None
    final_loss: float | None = None
    backward_s: float | None = None
    cpu_s: float | None = None  # one rank's process CPU time (all threads) per step
    cpu_busy: float | None = None  # that CPU time / wall time during the timed steps (cores)
    ranks_agree: bool | None = None
    codec_s: float | None = None  # one step's codec arithmetic on one rank (floor.py)
    floor_s: float | None = None  # max(compute + codec, link limit)
    floor_ratio: float | None = None  # step / floor
    bound: str | None = None  # "processor" or "link": what the rank CPU says limits it
    error: str | None = None


def summarize(results: dict[str, dict], n: int, rate_bits: float | None) -> list[Row]:
    """Rows in the order of ``results`` (config name -> merged result, or {"error": ...}).

    A merged result has ``rounds`` (each with ``step_times``, ``compute_times``,
    ``backward_times``, ``eval_loss``), ``batch``, ``wire_bytes``, ``ranks_agree``. Speed-up
    is against ``ddp-fp32`` when it ran (else empty); efficiency and comm wait against the
    configuration's own compute-only time.
    """
    base = results.get("ddp-fp32")
    base_step = (
        robust_step(base["rounds"], cycle=CONFIGS["ddp-fp32"].cycle)
        if base and "error" not in base
        else None
    )
    rows = []
    for name, r in results.items():
        cfg = CONFIGS[name]
        row = Row(name, cfg.label, cfg.kind)
        if "error" in r:
            row.error = r["error"]
            rows.append(row)
            continue
        step_s = robust_step(r["rounds"], cycle=cfg.cycle)
        if step_s is None:  # was a TypeError further down
            row.error = "no timed steps recorded (no round has step_times)"
            rows.append(row)
            continue
        row.step_s = step_s
        row.step_rounds = [round_step(rd["step_times"], cfg.cycle) for rd in r["rounds"]]
        row.compute_s = robust_step(r["rounds"], "compute_times")
        row.backward_s = robust_step(r["rounds"], "backward_times")
        row.cpu_busy = cpu_share(r["rounds"])
        if row.cpu_busy is not None:  # CPU per step at the median step: its share of the wall time
            row.cpu_s = row.cpu_busy * step_s
        row.samples_per_s = n * r["batch"] / step_s
        row.final_loss = r["rounds"][0].get("eval_loss")
        row.wire_bytes = r.get("wire_bytes")
        row.ranks_agree = r.get("ranks_agree")
        if base_step is not None:
            row.speedup = base_step / step_s
        if row.wire_bytes is not None:
            row.limit_s = allreduce_limit_s(row.wire_bytes, n, rate_bits)
        codecs = [rd["codec_s"] for rd in r["rounds"] if rd.get("codec_s") is not None]
        row.codec_s = statistics.median(codecs) if codecs else None
        if row.codec_s is not None:  # reports from before the floor have no codec time
            row.floor_s = floor_s(row.compute_s, row.codec_s, row.limit_s)
            row.floor_ratio = step_s / row.floor_s if row.floor_s else None
        row.bound = bound(row)
        paired = [e for rd in r["rounds"] for e in (rd.get("block_efficiency") or [])]
        if paired:  # each block against the compute-only steps right after it
            row.efficiency = statistics.median(paired)
            row.comm_wait = max(0.0, 1.0 - row.efficiency)
        elif row.compute_s is not None:
            row.efficiency = efficiency(step_s, row.compute_s)
            row.comm_wait = comm_wait_share(step_s, row.compute_s)
        rows.append(row)
    return rows


def bound(row: Row) -> str | None:
    """Which term makes the floor: "link" when the wire time exceeds compute + codec, else
    "processor" (the step's own processor work is the least it can take). The rank CPU
    column says how much of a core the rank got: on a shared machine, less than one."""
    if row.compute_s is None:
        return None
    work = row.compute_s + (row.codec_s or 0.0)
    return "link" if row.limit_s is not None and row.limit_s > work else "processor"


def _step_s(row: Row) -> float:
    if row.step_s is None:
        raise ValueError(f"{row.config}: no step time ({row.error or 'not measured'})")
    return row.step_s


def check_targets(role: str, rows: list[Row]) -> list[str]:
    """The issue's targets for a model of ``role`` ("communication" or "compute"), met or not."""
    ok = [r for r in rows if r.step_s is not None]
    commopt = [r for r in ok if r.kind == "commopt"]
    if not commopt:
        return []
    lines = []
    if role == "communication":
        best = min(commopt, key=_step_s)
        if best.speedup is not None:
            lines.append(
                f"best commopt ({best.config}) is {best.speedup:.2f}x faster per step "
                f"than DDP fp32 (target >= 5x: {'met' if best.speedup >= 5 else 'NOT met'})"
            )
        hooks = [r for r in ok if r.kind == "ddp" and r.config != "ddp-fp32"]
        if hooks:
            hook = min(hooks, key=_step_s)
            ratio = _step_s(hook) / _step_s(best)
            lines.append(
                f"best commopt is {ratio:.2f}x faster than the best DDP hook "
                f"({hook.config}, {_step_s(hook) * 1e3:.0f} ms) "
                f"(target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'})"
            )
            if best.cpu_s is not None and best.limit_s is not None:
                floor = (
                    (
                        f"; step / floor {best.floor_ratio:.2f}x (floor {best.floor_s * 1e3:.0f} ms, "
                        f"set by the {best.bound}; target <= 1.15x: "
                        f"{'met' if best.floor_ratio <= 1.15 else 'NOT met'})"
                    )
                    if best.floor_ratio and best.floor_s
                    else ""
                )
                lines.append(
                    f"best commopt's rank keeps {best.cpu_busy:.2f} cores busy "
                    f"({best.cpu_s * 1e3:.0f} ms of CPU per {_step_s(best) * 1e3:.0f} ms step) "
                    f"against a link limit of {best.limit_s * 1e3:.0f} ms{floor}"
                )
    elif role == "compute":
        eff = [(r.efficiency, r) for r in commopt if r.efficiency is not None]
        if eff:
            e, best = max(eff, key=lambda pair: pair[0])
            lines.append(
                f"best commopt scaling efficiency {e:.0%} ({best.config}) "
                f"(target >= 90%: {'met' if e >= 0.9 else 'NOT met'})"
            )
    return lines


def merge_rounds(entries: list[dict]) -> dict:
    """One configuration's runs (every rank, every round) -> the merged result ``summarize`` reads.

    ``entries`` are the worker's records: config, round, rank, size, batch, step_times,
    compute_times, backward_times, cpu_per_step (optional), losses, eval_loss, checksum,
    wire_bytes, params.
    """
    by_round: dict[int, dict[int, dict]] = {}
    for e in entries:
        by_round.setdefault(e["round"], {})[e["rank"]] = e
    rounds, agree = [], True
    for k in sorted(by_round):
        ranks = by_round[k]
        first = ranks[min(ranks)]
        rounds.append(
            {
                key: first.get(key)
                for key in (
                    "step_times",
                    "compute_times",
                    "block_efficiency",
                    "backward_times",
                    "cpu_per_step",
                    "codec_s",
                    "losses",
                    "eval_loss",
                )
            }
        )
        rounds[-1]["rank_step_medians"] = [
            statistics.median(ranks[r]["step_times"]) for r in sorted(ranks)
        ]
        agree = agree and len({ranks[r]["checksum"] for r in ranks}) == 1
    first = entries[0]
    merged = {
        "rounds": rounds,
        "batch": first["batch"],
        "size": first["size"],
        "wire_bytes": first["wire_bytes"],
        "params": first["params"],
        "ranks_agree": agree,
    }
    profiles = {str(e["rank"]): e["profile"] for e in entries if e.get("profile")}
    if profiles:
        merged["profile"] = profiles
    return merged
