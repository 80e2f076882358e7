"""Validation table of the scaling simulator: predicted vs published vs measured.

    $ python benchmarks/sim_validation.py                     # text tables
    $ python benchmarks/sim_validation.py --markdown          # the tables in docs/scaling.md
    $ python benchmarks/sim_validation.py --measured a.json --measured b.json

Every testbed row comes from a measurement file (``--measured``, repeatable; default
``benchmarks/results/sim-testbed-1gbit.json`` and ``sim-testbed-steps-1gbit.json``, those that
exist), a list of :class:`commopt.sim.validation.Measurement` entries as
``benchmarks/allreduce_link.py --sim-measurements`` (allreduce alone) and
``benchmarks/step_bench.py --sim-measurements`` (training steps) write them: what ran, the exact command, hosts, compute seconds per
step, gradient bytes, the measured seconds (median over rounds) and, where the writer has
them, the transport, the rounds' range and the machine's load. ``--codec-bench FILE`` (the
output of ``benchmarks/codec_perf.py --json``) replaces the testbed presets' codec speeds.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from commopt.sim import Plan, get_machine, simulate
from commopt.sim.codec_costs import from_benchmark
from commopt.sim.validation import (TOLERANCE, chainermn_effect, cgx_effect, compare_testbed_measurements,
                                    load_measurements, published_comparison)

RESULTS = Path(__file__).resolve().parent / "results"
#: Allreduce rows (benchmarks/allreduce_link.py) and training-step rows (benchmarks/step_bench.py).
DEFAULT_MEASURED = (RESULTS / "sim-testbed-1gbit.json", RESULTS / "sim-testbed-steps-1gbit.json")


def _table(header, rows, markdown):
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [header] + rows)


def published_table(markdown: bool, measured: dict) -> str:
    rows = []
    for c in published_comparison():
        r = c.row
        status = "anchor" if r.gpus == 1 else (
            "ok" if abs(c.error) <= TOLERANCE else ("known miss" if c.known_miss else "MISS"))
        if c.caveat and status == "ok":
            status = "ok, assumption-dependent"
        key = (r.model, r.machine, r.gpus)
        source = "CGX" if r.source.startswith("CGX") else "NVIDIA DLE, batch 16"
        rows.append([r.model, r.machine, source, r.gpus, f"{c.predicted:,.0f}", f"{r.published:,.0f}",
                     measured.get(key, "n/a (hardware not available)"), f"{c.error:+.1%}", status])
    return _table(["model", "machine", "source", "GPUs", "predicted", "published", "measured", "pred/pub - 1",
                   "status"],
                  rows, markdown)


def effects_table(markdown: bool) -> str:
    rows = []
    for e in (chainermn_effect(), cgx_effect("bert-large"), cgx_effect("transformer-xl-base")):
        rows.append([e.name, e.published, f"{e.predicted_value:.1%}", f"{e.baseline_value:.1%}",
                     f"{e.error:+.1%}", e.detail])
    return _table(["effect", "published", "predicted with", "predicted without", "pred/pub - 1", "baseline"],
                  rows, markdown)


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f} ms"


def rows_for_testbed(measurements, codec_speeds=()) -> list[dict]:
    return compare_testbed_measurements(measurements, codec_speeds)


def _status(r: dict) -> str:
    status = r["status"]
    if r["evidence"]:
        f, q = r["evidence"]["fastest"], r["evidence"]["quietest"]
        at = "" if f["load_average"] is None else f" at load {f['load_average']:.1f}"
        status += f": fastest round {f['time_s'] * 1e3:.1f} ms{at} ({f['error']:+.1%})"
        if q is not f and q["time_s"] != f["time_s"]:
            status += (f", round at the lowest load ({q['load_average']:.1f}) {q['time_s'] * 1e3:.1f} ms "
                       f"({q['error']:+.1%})")
    return status


def _measured_cells(r: dict) -> tuple[str, str]:
    spread = ""
    if r["measured_min_s"] is not None and r["measured_max_s"] is not None:
        spread = f" ({r['measured_min_s'] * 1e3:.1f}-{r['measured_max_s'] * 1e3:.1f})"
    load = "" if not r["load_average"] else f"{min(r['load_average']):.1f}-{max(r['load_average']):.1f}"
    return _ms(r["measured_step_s"]) + spread, load


def _error(r: dict) -> str:
    return "n/a" if r["error"] is None else f"{r['error']:+.1%}"


def render_testbed_table(markdown: bool, rows: list[dict]) -> str:
    """The allreduce rows (an allreduce alone per measurement)."""
    out = []
    for r in rows:
        measured, load = _measured_cells(r)
        out.append([r["what"], r["machine"], _ms(r["predicted_step_s"]) or "n/a", _ms(r["limit_s"]),
                    measured, load, _error(r), _status(r)])
    return _table(["testbed run", "preset", "predicted", "link limit", "measured: median (min-max)", "load",
                   "pred/meas - 1", "status"], out, markdown)


def render_step_table(markdown: bool, rows: list[dict]) -> str:
    """The training-step rows: the measured compute (an input) beside the predicted step."""
    out = []
    for r in rows:
        measured, load = _measured_cells(r)
        status = _status(r)
        if r["status"] == "miss":
            # What the model has each resource do: the core (compute + codec) and the link.
            status += (f"; the model's core work {(r['compute_s'] + r['codec_s']) * 1e3:.0f} ms (compute + "
                       f"codec {r['codec_s'] * 1e3:.0f}), its communication {r['comm_s'] * 1e3:.0f} ms")
            if r.get("measured_cpu_s"):
                status += f"; measured: one rank used {r['measured_cpu_s'] * 1e3:.0f} ms of CPU per step"
        out.append([r["what"], r["machine"], _ms(r["compute_s"]), _ms(r["predicted_step_s"]) or "n/a",
                    _ms(r["limit_s"]), measured, load, _error(r), status])
    return _table(["testbed step", "preset", "compute (measured)", "predicted step", "link limit",
                   "measured: median (min-max)", "load", "pred/meas - 1", "status"], out, markdown)


def summarize_testbed(rows: list[dict]) -> str:
    modelled = [r for r in rows if r["status"] != "not modelled"]
    ok = [r for r in modelled if r["status"] == "ok"]
    others = len(rows) - len(modelled)
    lines = [f"{len(ok)} of {len(modelled)} modelled rows within {TOLERANCE:.0%}"
             + (f" ({others} row{'s' if others != 1 else ''} the simulator does not model)."
                if others else ".")]
    kinds = list(dict.fromkeys(r.get("kind", "allreduce") for r in rows))
    if len(kinds) > 1:
        for kind in kinds:
            mine = [r for r in modelled if r.get("kind", "allreduce") == kind]
            lines.append(f"- {kind} rows: {sum(r['status'] == 'ok' for r in mine)} of {len(mine)} within "
                         f"{TOLERANCE:.0%}")
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] == "not modelled":
            labels = reasons.setdefault(r["reason"], [])
            if r.get("label", r["transport"]) not in labels:
                labels.append(r.get("label", r["transport"]))
    lines += [f"- not modelled, {', '.join(labels)}: {reason}" for reason, labels in reasons.items()]
    return "\n".join(lines)


def testbed_tables(markdown: bool, rows: list[dict]) -> str:
    """The allreduce table, the step table (where there are rows of each) and the summary."""
    parts = []
    allreduce = [r for r in rows if r.get("kind", "allreduce") == "allreduce"]
    steps = [r for r in rows if r.get("kind") == "step"]
    if allreduce:
        parts.append(render_testbed_table(markdown, allreduce))
    if steps:
        parts.append(render_step_table(markdown, steps))
    parts.append(summarize_testbed(rows))
    return "\n\n".join(parts)


def predictions_table(markdown: bool) -> str:
    """1024 V100s (8 per node) on 25, 100 and 400 Gbit/s, with and without compression."""
    rows = []
    for model in ("resnet50", "bert-large", "transformer-xl-base"):
        for gbps in (25, 100, 400):
            m = get_machine("v100-nvlink-25g").with_overrides(inter_gbps=gbps)
            cells = [model, f"{gbps} Gbit/s"]
            for codec in ("none", "fp16", "qsgd4"):
                p = simulate(model, m, Plan("auto", codec, 25, "backward"), 1024)
                cells.append(f"{p.efficiency:.0%} ({p.algorithm})")
            for codec in ("fp16", "qsgd4"):
                p = simulate(model, m, Plan("auto", codec, 25, "double-buffering"), 1024)
                cells.append(f"{p.efficiency:.0%}")
            rows.append(cells)
    return _table(["model", "inter-node link", "no compression", "fp16", "qsgd4 (4 bit)",
                   "fp16 + double buffering", "qsgd4 + double buffering"], rows, markdown)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--measured", action="append", default=None, metavar="JSON",
                    help="testbed measurements (repeatable; default: "
                         + ", ".join(os.path.relpath(p) for p in DEFAULT_MEASURED) + ", those that exist)")
    ap.add_argument("--codec-bench", default=None, metavar="JSON",
                    help="benchmarks/codec_perf.py --json output: codec speeds for the testbed presets")
    args = ap.parse_args(argv)
    paths = args.measured if args.measured is not None else [str(p) for p in DEFAULT_MEASURED if p.exists()]
    measurements = [m for path in paths for m in load_measurements(path)]
    speeds = ()
    if args.codec_bench:
        found = []
        for name in ("qsgd2", "qsgd4", "qsgd8"):
            try:
                c = from_benchmark(args.codec_bench, name)
            except ValueError:
                continue
            found.append((name, c.encode_elems_per_s * 4 / 1e9, c.decode_elems_per_s * 4 / 1e9))
        if not found:
            ap.error(f"--codec-bench {args.codec_bench}: no QSGD rows found")
        speeds = tuple(found)
    print("## Published scaling rows (PyTorch + NCCL, no compression)\n")
    print(published_table(args.markdown, {}))
    print("\n## Published effects\n")
    print(effects_table(args.markdown))
    print("\n## Testbed\n")
    if measurements:
        print("Measurements: " + ", ".join(os.path.relpath(p) for p in paths) + "\n")
        print(testbed_tables(args.markdown, rows_for_testbed(measurements, speeds)))
    else:
        print("no measurement file: pass --measured (benchmarks/allreduce_link.py --sim-measurements or "
              "benchmarks/step_bench.py --sim-measurements writes one)")
    print("\n## Parallel efficiency of 1024 V100 (8 per node), DDP buckets of 25 MB\n")
    print(predictions_table(args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
