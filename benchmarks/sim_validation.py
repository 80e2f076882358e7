"""Validation table of the scaling simulator: predicted vs published vs measured.

    $ python benchmarks/sim_validation.py                     # text tables
    $ python benchmarks/sim_validation.py --markdown          # the tables in docs/scaling.md
    $ python benchmarks/sim_validation.py --measured a.json --measured b.json
    $ python benchmarks/sim_validation.py --write-docs docs/scaling.md  # regenerate the doc's tables

Every testbed row comes from a measurement file (``--measured``, repeatable; default
``benchmarks/results/sim-testbed-1gbit.json`` and ``sim-testbed-steps-1gbit.json``, those that
exist), a list of :class:`commopt.sim.validation.Measurement` entries as
``benchmarks/allreduce_link.py --sim-measurements`` (allreduce alone) and
``commopt bench step --sim-measurements`` (training steps) write them: what ran, the exact command, hosts, compute seconds per
step, gradient bytes, the measured seconds (median over rounds) and, where the writer has
them, the transport, the rounds' range and the machine's load. ``--codec-bench FILE`` (the
output of ``benchmarks/codec_perf.py --json``) replaces the testbed presets' codec speeds.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from commopt.sim import simulate
from commopt.sim.codec_costs import from_benchmark
from commopt.sim.effects import (
    EFFECT_TOLERANCE,
    FASTSOCKET_SEQS,
    all_effects,
    chainermn_network_comparison,
    ec2_socket_ratio,
    gcp_fastsocket_sensitivity,
)
from commopt.sim.loo import choice_alternatives, leave_one_out
from commopt.sim.machines import PRESETS
from commopt.sim.software import software_plan
from commopt.sim.validation import (
    TOLERANCE,
    compare_testbed_measurements,
    load_measurements,
    published_comparison,
)
from commopt.tables import table

RESULTS = Path(__file__).resolve().parent / "results"
#: Allreduce rows (benchmarks/allreduce_link.py) and training-step rows (commopt bench step).
DEFAULT_MEASURED = (RESULTS / "sim-testbed-1gbit.json", RESULTS / "sim-testbed-steps-1gbit.json")


def _table(header, rows, markdown):
    return table(header, rows, markdown=markdown, align="l" * len(header))


def published_table(markdown: bool, measured: dict) -> str:
    rows = []
    for c in published_comparison():
        r = c.row
        status = (
            "anchor"
            if r.gpus == 1
            else ("ok" if abs(c.error) <= TOLERANCE else ("known miss" if c.known_miss else "MISS"))
        )
        if c.caveat and status == "ok":
            status = "ok, assumption-dependent"
        key = (r.model, r.machine, r.gpus)
        source = "CGX" if r.source.startswith("CGX") else "NVIDIA DLE, batch 16"
        rows.append(
            [
                r.model,
                r.machine,
                source,
                r.gpus,
                f"{c.predicted:,.0f}",
                f"{r.published:,.0f}",
                measured.get(key, "n/a (hardware not available)"),
                f"{c.error:+.1%}",
                status,
            ]
        )
    return _table(
        [
            "model",
            "machine",
            "source",
            "GPUs",
            "predicted",
            "published",
            "measured",
            "pred/pub - 1",
            "status",
        ],
        rows,
        markdown,
    )


def effects_table(markdown: bool) -> str:
    rows = []
    for e in all_effects():
        direction = (e.predicted_value > e.baseline_value) == (e.published_value > e.baseline_value)
        status = (
            "ok"
            if direction and abs(e.error) <= EFFECT_TOLERANCE
            else ("direction only" if direction else "MISS (direction)")
        )
        rows.append(
            [
                e.name,
                e.published,
                f"{e.predicted_value:.3g}",
                f"{e.baseline_value:.3g}",
                f"{e.error:+.1%}",
                status,
                e.detail,
            ]
        )
    return _table(
        [
            "effect",
            "published",
            "predicted with",
            "predicted without",
            "pred/pub - 1",
            f"direction, size within {EFFECT_TOLERANCE:.0%}",
            "notes",
        ],
        rows,
        markdown,
    )


def socket_sizes_table(markdown: bool) -> str:
    """The EC2 socket-thread effect by message size (2 nodes, one rank each)."""
    rows = []
    for nbytes in (64e3, 256e3, 1e6, 4e6, 64e6, 1e9):
        default, tuned = ec2_socket_ratio(nbytes)
        rows.append(
            [f"{nbytes / 1e6:g} MB", f"{default:.2f}", f"{tuned:.2f}", f"{tuned / default:.2f}x"]
        )
    return _table(
        ["all-reduce size", "busbw, NCCL defaults (GB/s)", "busbw, 4 x 4 sockets (GB/s)", "ratio"],
        rows,
        markdown,
    )


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def loo_table(markdown: bool, measurements=()) -> str:
    rows = []
    for r in leave_one_out(measurements):
        params = "; ".join(f"{p}: {a} -> {b}" for p, a, b in r.parameters)
        status = "ok" if r.within else ("known miss" if r.note.startswith("known") else "MISS")
        rows.append(
            [r.row, params, _pct(r.in_sample_error), _pct(r.out_of_sample_error), status, r.note]
        )
    return _table(
        [
            "row left out",
            "parameter(s) it informed: in sample -> out of sample",
            "in-sample error",
            "out-of-sample error",
            f"out of sample within {TOLERANCE:.0%}",
            "note",
        ],
        rows,
        markdown,
    )


_ABBREV = {
    "transformer-xl-base": "TXL",
    "bert-large": "BERT",
    "rtx3090-pcie": "3090",
    "v100-nvlink-25g": "V100",
}


def _abbrev(row_id: str) -> str:
    """'transformer-xl-base on rtx3090-pcie, 4 GPUs (CGX)' -> 'TXL/3090/4'."""
    model, rest = row_id.split(" on ", 1)
    machine, rest = rest.split(", ", 1)
    gpus = rest.split(" ")[0]
    return f"{_ABBREV.get(model, model)}/{_ABBREV.get(machine, machine)}/{gpus}" + (
        " (DLE)" if "DLE" in rest else ""
    )


def choices_table(markdown: bool) -> str:
    """Every candidate of every choice made with published rows in view, with its errors."""
    rows = []
    for parameter, label, chosen, worst, errs in choice_alternatives():
        short = ", ".join(f"{_abbrev(k)} {v:+.0%}" for k, v in errs.items())
        rows.append([parameter, label + (" (preset)" if chosen else ""), f"{worst:.0%}", short])
    return _table(
        [
            "choice",
            "candidate",
            "worst error over the rows it informs",
            "errors (model/machine/GPUs)",
        ],
        rows,
        markdown,
    )


def fastsocket_table(markdown: bool) -> str:
    """The Fast Socket effect under each baseline NCCL's code gives on gVNIC and each batch."""
    rows = [
        [label] + [f"{r:.2f}x" for r in ratios.values()]
        for label, ratios in gcp_fastsocket_sensitivity()
    ]
    return _table(
        ["baseline (Fast Socket: 4 sockets x 4 threads)"]
        + [f"{s} x 384 tokens per GPU" for s in FASTSOCKET_SEQS],
        rows,
        markdown,
    )


def held_out_table(markdown: bool) -> str:
    c = chainermn_network_comparison()
    rows = [
        [
            "10 GbE / InfiniBand FDR step time, pure_nccl FP32, no overlap",
            f"{c.slowdown:.2f}x",
            "far larger than the 1.33x this simulator predicted before its transport model",
        ],
        [
            "10 GbE with double buffering + FP16 / InfiniBand without them",
            f"{c.features_vs_ib:.2f}x",
            "> 1: the 10 GbE run with both features was slower",
        ],
    ]
    return _table(
        ["ChainerMN ResNet-50, 32 P100 (held out)", "predicted", "published"], rows, markdown
    )


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
            status += (
                f", round at the lowest load ({q['load_average']:.1f}) {q['time_s'] * 1e3:.1f} ms "
                f"({q['error']:+.1%})"
            )
    return status


#: The testbed tables' last columns: the link's limit, the measurement and the verdict.
_MEASURED_COLUMNS = ("link limit", "measured: median (min-max)", "load", "pred/meas - 1", "status")


def _measured_cells(r: dict) -> tuple[str, str]:
    spread = ""
    if r["measured_min_s"] is not None and r["measured_max_s"] is not None:
        spread = f" ({r['measured_min_s'] * 1e3:.1f}-{r['measured_max_s'] * 1e3:.1f})"
    load = (
        ""
        if not r["load_average"]
        else f"{min(r['load_average']):.1f}-{max(r['load_average']):.1f}"
    )
    return _ms(r["measured_step_s"]) + spread, load


def _error(r: dict) -> str:
    return "n/a" if r["error"] is None else f"{r['error']:+.1%}"


def render_testbed_table(markdown: bool, rows: list[dict]) -> str:
    """The allreduce rows (an allreduce alone per measurement)."""
    out = []
    for r in rows:
        measured, load = _measured_cells(r)
        out.append(
            [
                r["what"],
                r["machine"],
                _ms(r["predicted_step_s"]) or "n/a",
                _ms(r["limit_s"]),
                measured,
                load,
                _error(r),
                _status(r),
            ]
        )
    return _table(
        ["testbed run", "preset", "predicted", *_MEASURED_COLUMNS],
        out,
        markdown,
    )


def render_step_table(markdown: bool, rows: list[dict]) -> str:
    """The training-step rows: the measured compute (an input) beside the predicted step."""
    out = []
    for r in rows:
        measured, load = _measured_cells(r)
        status = _status(r)
        if r["status"] == "miss":
            # What the model has each resource do: the core (compute + codec) and the link.
            status += (
                f"; the model's core work {(r['compute_s'] + r['codec_s']) * 1e3:.0f} ms (compute + "
                f"codec {r['codec_s'] * 1e3:.0f}), its communication {r['comm_s'] * 1e3:.0f} ms"
            )
            if r.get("measured_cpu_s"):
                status += (
                    f"; measured: one rank used {r['measured_cpu_s'] * 1e3:.0f} ms of CPU per step"
                )
        out.append(
            [
                r["what"],
                r["machine"],
                _ms(r["compute_s"]),
                _ms(r["predicted_step_s"]) or "n/a",
                _ms(r["limit_s"]),
                measured,
                load,
                _error(r),
                status,
            ]
        )
    return _table(
        ["testbed step", "preset", "compute (measured)", "predicted step", *_MEASURED_COLUMNS],
        out,
        markdown,
    )


def summarize_testbed(rows: list[dict]) -> str:
    modelled = [r for r in rows if r["status"] != "not modelled"]
    ok = [r for r in modelled if r["status"] == "ok"]
    others = len(rows) - len(modelled)
    lines = [
        f"{len(ok)} of {len(modelled)} modelled rows within {TOLERANCE:.0%}"
        + (
            f" ({others} row{'s' if others != 1 else ''} the simulator does not model)."
            if others
            else "."
        )
    ]
    kinds = list(dict.fromkeys(r.get("kind", "allreduce") for r in rows))
    if len(kinds) > 1:
        for kind in kinds:
            mine = [r for r in modelled if r.get("kind", "allreduce") == kind]
            lines.append(
                f"- {kind} rows: {sum(r['status'] == 'ok' for r in mine)} of {len(mine)} within "
                f"{TOLERANCE:.0%}"
            )
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] == "not modelled":
            labels = reasons.setdefault(r["reason"], [])
            if r.get("label", r["transport"]) not in labels:
                labels.append(r.get("label", r["transport"]))
    lines += [
        f"- not modelled, {', '.join(labels)}: {reason}" for reason, labels in reasons.items()
    ]
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


#: The presets of the prediction table: every machine preset whose GPU the model profiles know
#: (the testbed presets are CPU hosts with measured compute, not a GPU; no profile has them).
PREDICTION_PRESETS = (
    "v100-nvlink-25g",
    "p3dn-efa",
    "gcp-v100-100g",
    "azure-ndv4",
    "rtx3090-pcie",
    "p100-10gbe",
    "p100-ib-fdr",
)


def predictions_table(markdown: bool) -> str:
    """ResNet-50 from 8 to 4096 GPUs on every GPU preset: PyTorch DDP (NCCL ring/tree) and
    commopt with 4-bit QSGD, with the term that dominates each step."""
    rows = []
    for name in PREDICTION_PRESETS:
        m = PRESETS[name]
        for gpus in (8, 64, 512, 4096):
            cells = [name, m.transport.name if m.transport else "-", gpus]
            for plan in (
                software_plan("pytorch-ddp"),
                software_plan("commopt", compression="qsgd4"),
            ):
                p = simulate("resnet50", m, plan, gpus)
                cells += [f"{p.efficiency:.0%}", p.dominant]
            rows.append(cells)
    return _table(
        [
            "preset",
            "transport",
            "GPUs",
            "DDP efficiency",
            "DDP dominant term",
            "commopt qsgd4 efficiency",
            "commopt qsgd4 dominant term",
        ],
        rows,
        markdown,
    )


def write_docs(path: str, sections: dict[str, str]) -> None:
    """Replace each ``<!-- sim_validation:NAME -->`` ... ``<!-- /sim_validation:NAME -->``
    region of ``path`` with the table NAME."""
    with open(path) as f:
        doc = f.read()
    for name, text in sections.items():
        pattern = re.compile(
            rf"(<!-- sim_validation:{name} -->\n).*?(<!-- /sim_validation:{name} -->)", re.S
        )
        if not pattern.search(doc):
            raise SystemExit(
                f"{path}: no <!-- sim_validation:{name} --> ... <!-- /sim_validation:{name} --> region"
            )
        doc = pattern.sub(lambda mt, text=text: mt.group(1) + text + "\n" + mt.group(2), doc)
    with open(path, "w") as f:
        f.write(doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument(
        "--measured",
        action="append",
        default=None,
        metavar="JSON",
        help="testbed measurements (repeatable; default: "
        + ", ".join(os.path.relpath(p) for p in DEFAULT_MEASURED)
        + ", those that exist)",
    )
    ap.add_argument(
        "--write-docs",
        default=None,
        metavar="MD",
        help="write the tables into the marked regions of this markdown file (docs/scaling.md)",
    )
    ap.add_argument(
        "--codec-bench",
        default=None,
        metavar="JSON",
        help="benchmarks/codec_perf.py --json output: codec speeds for the testbed presets",
    )
    args = ap.parse_args(argv)
    paths = (
        args.measured
        if args.measured is not None
        else [str(p) for p in DEFAULT_MEASURED if p.exists()]
    )
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
    testbed = (
        testbed_tables(
            True if args.write_docs else args.markdown, rows_for_testbed(measurements, speeds)
        )
        if measurements
        else "no measurement file: pass --measured (benchmarks/allreduce_link.py --sim-measurements or "
        "commopt bench step --sim-measurements writes one)"
    )
    md = True if args.write_docs else args.markdown
    sections = {
        "published": published_table(md, {}),
        "choices": choices_table(md),
        "loo": loo_table(md, measurements),
        "effects": effects_table(md),
        "sockets": socket_sizes_table(md),
        "fastsocket": fastsocket_table(md),
        "held-out": held_out_table(md),
        "testbed": testbed,
        "predictions": predictions_table(md),
    }
    if args.write_docs:
        write_docs(args.write_docs, sections)
        print(f"wrote {len(sections)} tables into {args.write_docs}")
        return 0
    titles = {
        "published": "Published scaling rows (PyTorch DDP + NCCL, no compression)",
        "choices": "Choices made with published rows in view, and their alternatives",
        "loo": "Leave-one-out: in-sample and out-of-sample errors",
        "effects": "Published effects",
        "sockets": "NCCL socket threads on EC2 by message size",
        "fastsocket": "Fast Socket on Google Cloud by baseline and batch",
        "held-out": "Held out: 10 GbE vs InfiniBand",
        "testbed": "Testbed",
        "predictions": "ResNet-50 to 4096 GPUs on every GPU preset",
    }
    for name, text in sections.items():
        print(f"## {titles[name]}\n")
        if name == "testbed" and measurements:
            print("Measurements: " + ", ".join(os.path.relpath(p) for p in paths) + "\n")
        print(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
