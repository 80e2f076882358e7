"""Validation table of the scaling simulator: predicted vs published vs measured.

    $ python benchmarks/sim_validation.py                     # text tables
    $ python benchmarks/sim_validation.py --markdown          # the tables in docs/scaling.md
    $ python benchmarks/sim_validation.py --measured testbed.json   # add the testbed's numbers

``testbed.json`` is a list of measurements (see commopt.sim.validation.Measurement): what was
run, the exact command, GPUs (hosts), measured compute seconds per step, gradient bytes and the
measured step seconds. Without it the measured column says "pending".
"""
from __future__ import annotations

import argparse
import sys

from commopt.sim import Plan, get_machine, simulate
from commopt.sim.validation import (TOLERANCE, chainermn_effect, cgx_effect, compare_testbed_measurements,
                                    load_measurements, physical_allreduce_s, predict_testbed_allreduce,
                                    published_comparison)


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


def testbed_table(markdown: bool, measurements) -> str:
    size = 64 * 2**20
    limit = physical_allreduce_s(size, 2, 1.0)
    rows = [["fp32 all-reduce of 64 MiB, 2 hosts, 1 Gbit/s", f"{predict_testbed_allreduce(size) * 1e3:.0f} ms",
             f"{limit * 1e3:.0f} ms (2(n-1)/n x bytes / rate)", "pending (docs/benchmarks.md)", ""]]
    for m in compare_testbed_measurements(measurements):
        rows.append([m["what"], f"{m['predicted_step_s'] * 1e3:.0f} ms", "", f"{m['measured_step_s'] * 1e3:.0f} ms",
                     f"{m['error']:+.1%}"])
    return _table(["testbed run", "predicted", "physical limit", "measured", "pred/meas - 1"], rows, markdown)


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
    ap.add_argument("--measured", default=None, help="testbed measurements (JSON list)")
    args = ap.parse_args(argv)
    measurements = load_measurements(args.measured) if args.measured else []
    print("## Published scaling rows (PyTorch + NCCL, no compression)\n")
    print(published_table(args.markdown, {}))
    print("\n## Published effects\n")
    print(effects_table(args.markdown))
    print("\n## Testbed\n")
    print(testbed_table(args.markdown, measurements))
    print("\n## Parallel efficiency of 1024 V100 (8 per node), DDP buckets of 25 MB\n")
    print(predictions_table(args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
