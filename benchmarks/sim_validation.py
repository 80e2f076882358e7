"""Validation table of the scaling simulator: predicted vs published vs measured.

    $ python benchmarks/sim_validation.py                     # text tables
    $ python benchmarks/sim_validation.py --markdown          # the tables in docs/scaling.md
    $ python benchmarks/sim_validation.py --measured a.json --measured b.json

Every testbed row comes from a measurement file (``--measured``, repeatable; default
``benchmarks/results/sim-testbed-1gbit.json`` when it exists), a list of
:class:`commopt.sim.validation.Measurement` entries as ``benchmarks/allreduce_link.py
--sim-measurements`` writes them: what ran, the exact command, hosts, compute seconds per
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

DEFAULT_MEASURED = Path(__file__).resolve().parent / "results" / "sim-testbed-1gbit.json"


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


def render_testbed_table(markdown: bool, rows: list[dict]) -> str:
    out = []
    for r in rows:
        spread = ""
        if r["measured_min_s"] is not None and r["measured_max_s"] is not None:
            spread = f" ({r['measured_min_s'] * 1e3:.1f}-{r['measured_max_s'] * 1e3:.1f})"
        load = "" if not r["load_average"] else f"{min(r['load_average']):.1f}-{max(r['load_average']):.1f}"
        status = r["status"]
        if r["evidence"]:
            f, q = r["evidence"]["fastest"], r["evidence"]["quietest"]
            status += (f": fastest round {f['time_s'] * 1e3:.1f} ms at load {f['load_average']:.1f} "
                       f"({f['error']:+.1%})")
            if q is not f and q["time_s"] != f["time_s"]:
                status += (f", round at the lowest load ({q['load_average']:.1f}) {q['time_s'] * 1e3:.1f} ms "
                           f"({q['error']:+.1%})")
        out.append([r["what"], r["machine"], _ms(r["predicted_step_s"]), _ms(r["limit_s"]),
                    _ms(r["measured_step_s"]) + spread, load, f"{r['error']:+.1%}", status])
    return _table(["testbed run", "preset", "predicted", "link limit", "measured: median (min-max)", "load",
                   "pred/meas - 1", "status"], out, markdown)


def summarize_testbed(rows: list[dict]) -> str:
    modelled = [r for r in rows if r["status"] != "not modelled"]
    ok = [r for r in modelled if r["status"] == "ok"]
    others = len(rows) - len(modelled)
    lines = [f"{len(ok)} of {len(modelled)} modelled rows within {TOLERANCE:.0%}"
             + (f" ({others} row{'s' if others != 1 else ''} of transports the simulator does not model)."
                if others else ".")]
    reasons = {r["transport"]: r["reason"] for r in rows if r["status"] == "not modelled"}
    lines += [f"- not modelled, {transport}: {reason}" for transport, reason in reasons.items()]
    return "\n".join(lines)


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
                    help=f"testbed measurements (repeatable; default {os.path.relpath(DEFAULT_MEASURED)} "
                         "when it exists)")
    ap.add_argument("--codec-bench", default=None, metavar="JSON",
                    help="benchmarks/codec_perf.py --json output: codec speeds for the testbed presets")
    args = ap.parse_args(argv)
    paths = args.measured if args.measured is not None else (
        [str(DEFAULT_MEASURED)] if DEFAULT_MEASURED.exists() else [])
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
        rows = rows_for_testbed(measurements, speeds)
        print(render_testbed_table(args.markdown, rows))
        print()
        print(summarize_testbed(rows))
    else:
        print("no measurement file: pass --measured (benchmarks/allreduce_link.py --sim-measurements writes one)")
    print("\n## Parallel efficiency of 1024 V100 (8 per node), DDP buckets of 25 MB\n")
    print(predictions_table(args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
