"""Allreduce over an emulated link: mpi against torch.distributed (gloo), several rounds.

    $ python benchmarks/allreduce_link.py --link 1gbit --rounds 5 --out allreduce-1gbit.json
    $ python benchmarks/allreduce_link.py --from allreduce-1gbit.json --markdown --plots docs/plots

Each round runs, one after the other (so that load from other jobs falls on all of them
alike), under ``commopt launch -n 2 --link RATE``:

- ``mpi``: ``commopt bench allreduce --comm mpi`` with the communicator's defaults (pipelined
  segment transfers between hosts, commopt launch's TCP eager limit);
- ``torch``: the same with ``--comm torch`` (gloo), started with ``--launcher torch``;
- ``mpi-native`` (fp32 only): ``COMMOPT_MPI_PIPELINE=off`` and Open MPI's default TCP eager
  limit (64 KiB): Open MPI's own collectives, the state before the pipelined path;
- ``mpi-polled``: ``mpi`` with ``COMMOPT_MPI_WAIT=polled`` (the waits before pacing);
- ``mpi-before``, ``torch-before``: ``mpi`` and ``torch`` run from another checkout
  (``--before DIR``, e.g. ``git archive`` of an earlier commit plus the built
  ``commopt_ext/_cpu*.so``): a change against the code before it, in the same rounds.

Every row of the summary is the median over rounds of the bench's mean time (min-max beside
it), with the physical limit of the row: the codec's wire bytes through the link,
2(n-1)/n x wire / rate. The targets (fp32 at the largest size no slower than gloo and within
1.10x of the limit; qsgd4's effective bandwidth >= 6x fp32's) are checked on medians and on
each round's paired ratios. ``--plots DIR`` writes busbw against size, one PNG per codec.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from commopt.bench import harness
from commopt.tables import table

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
CONFIGS = {
    # name: (launcher, comm, extra environment, fp32 only)
    "mpi": ("mpi", "mpi", {}, False),
    "torch": ("torch", "torch", {}, False),
    # Before the pipelined path: Open MPI's own collectives with its own TCP eager limit.
    "mpi-native": (
        "mpi",
        "mpi",
        {
            "COMMOPT_MPI_PIPELINE": "off",
            "OMPI_MCA_btl_tcp_eager_limit": "65536",
            "OMPI_MCA_btl_tcp_rndv_eager_limit": "65536",
        },
        True,
    ),
}
# The same runs with another checkout of commopt (``--before DIR``): a change measured
# against the code before it, in the same rounds.
CONFIGS["mpi-before"] = ("mpi", "mpi", {}, False)
# The mpi transport's waits polling with short sleeps instead of paced naps.
CONFIGS["mpi-polled"] = ("mpi", "mpi", {"COMMOPT_MPI_WAIT": "polled"}, False)
CONFIGS["torch-before"] = ("torch", "torch", {}, False)
LABELS = {
    "mpi": "mpi (commopt, pipelined)",
    "torch": "torch (gloo)",
    "mpi-native": "mpi (Open MPI's own collectives)",
    "mpi-before": "mpi (commopt, before)",
    "mpi-polled": "mpi (commopt, polled waits)",
    "torch-before": "torch (gloo, before)",
}
TCP_PAYLOAD = 1448 / 1514  # TCP/IPv4 payload per Ethernet frame at MTU 1500


def bench_command(args, comm: str, codecs: str) -> list[str]:
    return [
        PY,
        "-m",
        "commopt",
        "bench",
        "allreduce",
        "--comm",
        comm,
        "-b",
        args.minbytes,
        "-e",
        args.maxbytes,
        "-f",
        str(args.stepfactor),
        "-n",
        str(args.iters),
        "-w",
        str(args.warmup),
        "-c",
        "0",
        "--codec",
        codecs,
    ]


def run_once(args, name: str) -> dict:
    launcher, comm, extra, fp32_only = CONFIGS[name]
    codecs = "fp32" if fp32_only else args.codecs
    launch = dict(link=args.link, launcher="torch" if launcher == "torch" else None)
    bench = bench_command(args, comm, codecs) + ["--json"]
    shown = harness.launch_command(
        args.nprocs, bench + ["OUT.json"], timeout=args.timeout, **launch
    )
    with tempfile.TemporaryDirectory(prefix="commopt-arlink-") as tmp:
        out = Path(tmp) / "bench.json"
        env = dict(extra)
        cwd = REPO
        if name.endswith("-before"):
            if not args.before:
                raise SystemExit(
                    f"--configs {name} needs --before DIR (a checkout of the code before)"
                )
            cwd = Path(args.before).resolve()
            env["PYTHONPATH"] = str(cwd)
        try:
            harness.launch(
                args.nprocs,
                bench + [str(out)],
                timeout=args.timeout,
                env=env,
                cwd=cwd,
                **launch,
            )
        except harness.RankJobFailed as exc:
            raise RuntimeError(f"{name}: {exc}") from None
        if not out.exists():
            raise RuntimeError(f"{name}: the ranks wrote no {out.name}")
        doc = json.loads(out.read_text())
    doc["config"] = name
    doc["environment"] = extra
    doc["shell_command"] = (
        " ".join(f"{k}={v}" for k, v in extra.items())
        + (" " if extra else "")
        + " ".join(["commopt"] + shown[3:]).replace(PY, "python")
    )
    if name.endswith("-before"):
        doc["code"] = f"checkout at {cwd}"
    doc["load_average"] = os.getloadavg()[0]
    return doc


def collect(args) -> dict:
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    runs = []
    for rnd in range(args.rounds):
        for name in args.configs.split(","):
            t0 = time.time()
            doc = run_once(args, name)
            doc["round"] = rnd
            runs.append(doc)
            print(
                f"round {rnd} {name}: {time.time() - t0:.0f} s, load {doc['load_average']:.1f}",
                file=sys.stderr,
                flush=True,
            )
    return {
        "link": args.link,
        "nprocs": args.nprocs,
        "rounds": args.rounds,
        "runs": runs,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# -- summary ----------------------------------------------------------------------------------


def summarize(data: dict) -> dict:
    """Median and range over rounds for every (config, codec, size)."""
    cells: dict[tuple, list] = {}
    for run in data["runs"]:
        for r in run["results"]:
            cells.setdefault((run["config"], r["codec"], r["size"]), []).append(r)
    link_bits = next(run["link_bits_per_s"] for run in data["runs"])
    n = data["nprocs"]
    factor = 2 * (n - 1) / n
    rows = []
    for (config, codec, size), rs in sorted(
        cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])
    ):
        times = [r["time_us"] * 1e-6 for r in rs]
        t = statistics.median(times)
        wire = rs[0]["wire_bytes"]
        floor = factor * wire * 8 / link_bits
        rows.append(
            {
                "config": config,
                "codec": codec,
                "size": size,
                "wire_bytes": wire,
                "time_s": t,
                "time_min_s": min(times),
                "time_max_s": max(times),
                "rounds": len(times),
                "busbw_gbps": factor * wire / t / 1e9,
                "effbw_gbps": factor * size / t / 1e9,
                "limit_s": floor,
                "tcp_limit_s": floor / TCP_PAYLOAD,
                "x_limit": t / floor,
            }
        )
    return {"link_bits_per_s": link_bits, "rows": rows}


def _row(summary, config, codec, size):
    for r in summary["rows"]:
        if (r["config"], r["codec"], r["size"]) == (config, codec, size):
            return r
    return None


def paired(data, a: tuple, b: tuple, size: int) -> list[float]:
    """Per-round ratio time(a) / time(b) at ``size``; a and b are (config, codec)."""
    out = []
    for rnd in range(data["rounds"]):
        ta = tb = None
        for run in data["runs"]:
            if run["round"] != rnd:
                continue
            for r in run["results"]:
                if r["size"] == size and (run["config"], r["codec"]) == a:
                    ta = r["time_us"]
                if r["size"] == size and (run["config"], r["codec"]) == b:
                    tb = r["time_us"]
        if ta and tb:
            out.append(ta / tb)
    return out


def targets(data, summary) -> list[dict]:
    largest = max(r["size"] for r in summary["rows"])
    out = []
    mpi, gloo = _row(summary, "mpi", "fp32", largest), _row(summary, "torch", "fp32", largest)
    if mpi and gloo:
        ratios = paired(data, ("mpi", "fp32"), ("torch", "fp32"), largest)
        out.append(
            {
                "target": f"fp32 {largest >> 20} MiB: mpi no slower than gloo",
                "measured": f"{mpi['time_s'] * 1e3:.0f} ms vs {gloo['time_s'] * 1e3:.0f} ms; "
                f"per round mpi/gloo {', '.join(f'{x:.2f}' for x in ratios)} "
                f"(median {statistics.median(ratios):.2f})",
                "met": mpi["time_s"] <= gloo["time_s"],
            }
        )
    if mpi:
        out.append(
            {
                "target": f"fp32 {largest >> 20} MiB: mpi within 1.10x of 2(n-1)/n x bytes / rate",
                "measured": f"{mpi['x_limit']:.3f}x ({mpi['time_s'] * 1e3:.0f} ms / "
                f"{mpi['limit_s'] * 1e3:.0f} ms; rounds "
                f"{mpi['time_min_s'] / mpi['limit_s']:.3f}-"
                f"{mpi['time_max_s'] / mpi['limit_s']:.3f}x)",
                "met": mpi["x_limit"] <= 1.10,
            }
        )
    for size in sorted({r["size"] for r in summary["rows"]}):
        q, f = _row(summary, "mpi", "qsgd4", size), _row(summary, "mpi", "fp32", size)
        if q and f and size >= (1 << 20):
            ratios = [1 / x for x in paired(data, ("mpi", "qsgd4"), ("mpi", "fp32"), size)]
            out.append(
                {
                    "target": f"qsgd4 {size >> 20} MiB on mpi: effective busbw >= 6x fp32's",
                    "measured": f"{q['effbw_gbps'] / f['effbw_gbps']:.2f}x "
                    f"({q['effbw_gbps']:.3f} vs {f['effbw_gbps']:.3f} GB/s); per round "
                    f"{', '.join(f'{x:.1f}' for x in ratios)}",
                    "met": q["effbw_gbps"] >= 6 * f["effbw_gbps"],
                }
            )
    return out


def sim_measurements(data, summary, sizes: list[int] | None = None) -> list[dict]:
    """Entries for ``benchmarks/sim_validation.py --measured``: one per (config, codec, size).

    An allreduce alone is a "step" with no compute (1 us, the simulator needs > 0) and one
    bucket of the whole buffer. The plan names what ran: fp32, fp16 and bf16 are summed by the
    transport (a ring: gloo's, the mpi communicator's pipelined one between hosts, or Open
    MPI's own for mpi-native); qsgd runs commopt's scatter-reduce/allgather (``scatter_reduce``). Beside
    the median: the transport (the config), the link rate, the fastest and slowest round and
    the 1-minute load average of the machine at each round (``per_round``: seconds and load).
    """
    sizes = sizes or [max(r["size"] for r in summary["rows"])]
    commands = {run["config"]: run["shell_command"] for run in data["runs"]}
    loads: dict[str, list[float]] = {}
    for run in data["runs"]:
        if "load_average" in run:
            loads.setdefault(run["config"], []).append(run["load_average"])
    out = []
    for r in summary["rows"]:
        if r["size"] not in sizes:
            continue
        native = r["codec"] in ("fp32", "fp16", "bf16")
        entry = {
            "what": f"allreduce {r['codec']} {_size(r['size'])}, {LABELS[r['config']]}, 2 hosts, "
            f"{summary['link_bits_per_s'] / 1e9:g} Gbit/s (median of {r['rounds']})",
            "command": commands[r["config"]],
            "gpus": data["nprocs"],
            "compute_s": 1e-6,
            "grad_bytes": r["size"],
            "measured_step_s": r["time_s"],
            "plan": {
                "algorithm": "ring" if native else "scatter_reduce",
                "compression": "none" if r["codec"] == "fp32" else r["codec"],
                "overlap": False,
                "bucket_cap_mb": r["size"] / 2**20,
            },
            "transport": r["config"],
            "link_bits_per_s": summary["link_bits_per_s"],
            "rounds": r["rounds"],
            "measured_min_s": r["time_min_s"],
            "measured_max_s": r["time_max_s"],
        }
        if loads.get(r["config"]):
            entry["load_average"] = [min(loads[r["config"]]), max(loads[r["config"]])]
            entry["per_round"] = [
                {"time_s": x["time_us"] * 1e-6, "load_average": run["load_average"]}
                for run in data["runs"]
                if run["config"] == r["config"] and "load_average" in run
                for x in run["results"]
                if (x["codec"], x["size"]) == (r["codec"], r["size"])
            ]
        out.append(entry)
    return out


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def markdown(data, summary) -> str:
    rate = summary["link_bits_per_s"]
    lines = []
    for codec in dict.fromkeys(r["codec"] for r in summary["rows"]):
        body = []
        for size in sorted({r["size"] for r in summary["rows"] if r["codec"] == codec}):
            for config in CONFIGS:
                r = _row(summary, config, codec, size)
                if r is None:
                    continue
                body.append(
                    [
                        _size(size),
                        _size(r["wire_bytes"]) if r["wire_bytes"] >= 1024 else r["wire_bytes"],
                        LABELS[config],
                        f"{r['time_s'] * 1e3:.1f} ms",
                        f"{r['time_min_s'] * 1e3:.1f}-{r['time_max_s'] * 1e3:.1f}",
                        f"{r['limit_s'] * 1e3:.1f} ms",
                        f"{r['x_limit']:.2f}",
                        f"{r['busbw_gbps']:.3f}",
                        f"{r['effbw_gbps']:.3f}",
                    ]
                )
        head = [
            "size",
            "wire",
            "comm",
            "time (median)",
            "rounds min-max",
            "limit",
            "x limit",
            "busbw GB/s",
            "effbw GB/s",
        ]
        lines += [f"#### {codec}", "", table(head, body, markdown=True, align="l" * len(head)), ""]
    lines += [
        f"Link {rate / 1e9:g} Gbit/s: busbw cannot exceed {rate / 8e9:.3f} GB/s "
        f"({rate / 8e9 * TCP_PAYLOAD:.3f} GB/s of TCP payload at MTU 1500).",
        "",
        table(
            ["target", "measured", "met"],
            [
                [t["target"], t["measured"], "yes" if t["met"] else "no"]
                for t in targets(data, summary)
            ],
            markdown=True,
            align="lll",
        ),
    ]
    lines += ["", "Commands (one round; rounds repeat them in this order):", ""]
    seen = set()
    for run in data["runs"]:
        if run["config"] not in seen:
            seen.add(run["config"])
            lines.append(f"    {run['shell_command']}")
    loads = [run["load_average"] for run in data["runs"]]
    lines += [
        "",
        f"Load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f} on "
        f"{os.cpu_count()} cores; {data['started']} to {data.get('finished', '?')}.",
    ]
    return "\n".join(lines)


def plot(summary, outdir: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("--plots needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    rate = summary["link_bits_per_s"] / 8e9
    paths = []
    for codec in dict.fromkeys(r["codec"] for r in summary["rows"]):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for config, style in (("mpi", "o-"), ("torch", "s--"), ("mpi-native", "x:")):
            rs = sorted(
                (r for r in summary["rows"] if r["config"] == config and r["codec"] == codec),
                key=lambda r: r["size"],
            )
            if not rs:
                continue
            xs = [r["size"] for r in rs]
            ax.plot(xs, [r["busbw_gbps"] for r in rs], style, label=LABELS[config])
            ax.fill_between(
                xs,
                [r["busbw_gbps"] * r["time_s"] / r["time_max_s"] for r in rs],
                [r["busbw_gbps"] * r["time_s"] / r["time_min_s"] for r in rs],
                alpha=0.15,
            )
        ax.axhline(rate, color="k", lw=1, label=f"link rate ({rate:.3f} GB/s)")
        ax.axhline(
            rate * TCP_PAYLOAD,
            color="gray",
            lw=1,
            ls="--",
            label=f"TCP payload at MTU 1500 ({rate * TCP_PAYLOAD:.3f})",
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("allreduce size (fp32 bytes)")
        ax.set_ylabel("busbw of the wire bytes (GB/s)")
        # Messages under the shaper's burst (128 KiB at 1 Gbit/s) can beat the rate.
        top = max(
            [rate]
            + [
                r["busbw_gbps"] * r["time_s"] / r["time_min_s"]
                for r in summary["rows"]
                if r["codec"] == codec
            ]
        )
        ax.set_ylim(0, top * 1.1)
        ticks = sorted({r["size"] for r in summary["rows"]})
        ax.set_xticks(ticks, [_size(t) for t in ticks])
        ax.set_title(
            f"{codec}: 2 hosts x 1 rank, {summary['link_bits_per_s'] / 1e9:g} Gbit/s link "
            f"(median, min-max band)",
            fontsize=9,
        )
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = outdir / f"allreduce-busbw-{codec}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    # Effective bandwidth (fp32 bytes / time) of every codec, one figure per transport: how
    # much faster than an fp32 allreduce each codec finishes.
    for config in ("mpi", "torch"):
        rows = [r for r in summary["rows"] if r["config"] == config]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for codec in dict.fromkeys(r["codec"] for r in rows):
            rs = sorted((r for r in rows if r["codec"] == codec), key=lambda r: r["size"])
            ax.plot([r["size"] for r in rs], [r["effbw_gbps"] for r in rs], "o-", label=codec)
        ax.axhline(rate, color="k", lw=1, label=f"link rate ({rate:.3f} GB/s)")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["size"] for r in rows})
        ax.set_xticks(ticks, [_size(t) for t in ticks])
        ax.set_xlabel("allreduce size (fp32 bytes)")
        ax.set_ylabel("effbw: fp32 bytes x 2(n-1)/n / time (GB/s)")
        ax.set_title(f"{LABELS[config]}: effective bandwidth per codec (median)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = outdir / f"allreduce-effbw-{config}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--configs", default="mpi,torch,mpi-native", help=f"comma list of {', '.join(CONFIGS)}"
    )
    ap.add_argument("--codecs", default="fp32,fp16,bf16,qsgd4,qsgd8")
    ap.add_argument("-b", "--minbytes", default="256K")
    ap.add_argument("-e", "--maxbytes", default="64M")
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=600, help="per run, seconds")
    ap.add_argument(
        "--before",
        metavar="DIR",
        help="checkout of the code before a change, for the *-before configs",
    )
    ap.add_argument("--out", help="write every run and the summary here (JSON)")
    ap.add_argument("--from", dest="from_", metavar="JSON", help="summarize saved runs instead")
    ap.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    ap.add_argument("--plots", metavar="DIR", help="write busbw-vs-size PNGs here")
    ap.add_argument(
        "--sim-measurements",
        metavar="JSON",
        help="write entries for benchmarks/sim_validation.py --measured",
    )
    ap.add_argument(
        "--sim-sizes",
        default=None,
        help="sizes for --sim-measurements, e.g. 16M,64M (default: the largest)",
    )
    args = ap.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        ap.error(
            f"unknown --configs {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}"
        )
    if args.from_:
        data = json.loads(Path(args.from_).read_text())
    else:
        data = collect(args)
    summary = summarize(data)
    data["summary"] = summary
    data["targets"] = targets(data, summary)
    if args.out and not args.from_:
        harness.write_json(args.out, data)
    if args.markdown:
        print(markdown(data, summary))
    else:
        for t in data["targets"]:
            print(f"{'MET ' if t['met'] else 'MISS'} {t['target']}: {t['measured']}")
    if args.sim_measurements:
        from commopt.bench.sizes import parse_size

        sizes = [parse_size(x) for x in args.sim_sizes.split(",")] if args.sim_sizes else None
        harness.write_json(args.sim_measurements, sim_measurements(data, summary, sizes))
    if args.plots:
        for p in plot(summary, Path(args.plots)):
            print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
