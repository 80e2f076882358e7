"""`commopt bench allreduce`: allreduce time and bandwidth over a sweep of sizes and codecs.

    $ commopt launch -n 2 --link 1gbit -- commopt bench allreduce --comm mpi \\
          -b 1M -e 16M -f 2 -n 10 -w 3 --codec fp32,fp16,qsgd4

Conventions follow nccl-tests' all_reduce_perf (``-b/-e/-f`` or ``-i``, ``-n`` iterations,
``-w`` warm-up, ``-c`` check). A *size* is the fp32 payload in bytes (``count`` = size / 4
elements); each row reduces it through one codec with ``commopt.collectives.allreduce``
(mean over ranks), and reports:

- ``wire``: bytes of one rank's encoded buffer, ``codec.encoded_nbytes(count)``;
- ``time``: mean time of one allreduce, the slowest rank's;
- ``algbw = wire / time`` and ``busbw = algbw * 2(n-1)/n``: what the links carried, so a
  busbw near the link rate means the network, not the code, is the limit;
- ``effbw = size / time * 2(n-1)/n``: the bus bandwidth an fp32 allreduce would need to
  finish as fast, the number to compare between codecs;
- ``error``: max |result - exact mean| / max |exact mean| (``-c 1``), exact in float64.

The summary line gives the mean busbw (and effbw) over the sizes, per codec, as nccl-tests
gives its "Avg bus bandwidth". ``--json`` prints one JSON document instead of the table.
On an emulated cluster (``commopt launch --link``) the header states the link rate, the
ceiling of busbw.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from commopt.bench.sizes import parse_size, sizes

DEFAULT_CODECS = "fp32"
SCHEMA_VERSION = 1
#: Set by `commopt launch --link` on emulated clusters: the link rate in bits per second.
LINK_ENV = "COMMOPT_LINK_BITS"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-b", "--minbytes", default="1M", help="smallest size (default 1M)")
    parser.add_argument("-e", "--maxbytes", default="16M", help="largest size (default 16M)")
    parser.add_argument(
        "-f",
        "--stepfactor",
        type=int,
        default=2,
        help="multiply the size by this between rows (default 2)",
    )
    parser.add_argument(
        "-i", "--stepbytes", default="0", help="add this many bytes between rows instead of -f"
    )
    parser.add_argument("-n", "--iters", type=int, default=10, help="timed iterations (10)")
    parser.add_argument(
        "-w", "--warmup_iters", type=int, default=3, help="untimed iterations first (3)"
    )
    parser.add_argument(
        "-c",
        "--check",
        type=int,
        default=1,
        choices=(0, 1),
        help="1: measure the error against the exact mean (default)",
    )
    parser.add_argument(
        "--comm",
        default="mpi",
        help="communicator: mpi, torch, pure_nccl, local, horovod (default mpi)",
    )
    parser.add_argument(
        "--codec",
        default=DEFAULT_CODECS,
        help="comma-separated codecs, e.g. fp32,fp16,bf16,qsgd4,qsgd8",
    )
    parser.add_argument(
        "--algorithm",
        default="auto",
        help="auto, native, scatter_reduce or hierarchical (default auto)",
    )
    parser.add_argument(
        "--device", default="auto", help="cpu or cuda (default: cuda for pure_nccl, else cpu)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of rounding")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="print one JSON document (to PATH, or stdout) instead of the table",
    )


@dataclass
class Row:
    size: int  # fp32 bytes
    count: int
    type: str
    codec: str
    wire_bytes: int
    time_us: float
    algbw_gbps: float  # GB/s = 1e9 bytes/s, as nccl-tests
    busbw_gbps: float
    effective_busbw_gbps: float
    max_rel_error: float | None


def bus_factor(nranks: int) -> float:
    """nccl-tests' allreduce bus factor 2(n-1)/n: each byte crosses a link 2(n-1)/n times."""
    return 2.0 * (nranks - 1) / nranks


def make_row(
    size: int, codec: str, wire_bytes: int, seconds: float, nranks: int, error: float | None
) -> Row:
    """One table row from what was measured (pure arithmetic).

    >>> r = make_row(8_000_000, "fp16", 4_000_000, 0.004, 4, None)
    >>> r.algbw_gbps, r.busbw_gbps, r.effective_busbw_gbps
    (1.0, 1.5, 3.0)
    """
    algbw = wire_bytes / seconds / 1e9
    return Row(
        size=size,
        count=size // 4,
        type="float",
        codec=codec,
        wire_bytes=wire_bytes,
        time_us=seconds * 1e6,
        algbw_gbps=algbw,
        busbw_gbps=algbw * bus_factor(nranks),
        effective_busbw_gbps=size / seconds / 1e9 * bus_factor(nranks),
        max_rel_error=error,
    )


def summarize(rows: list[Row]) -> dict[str, dict[str, float]]:
    """Mean busbw and effective busbw over the sizes, per codec."""
    out: dict[str, dict[str, float]] = {}
    for codec in dict.fromkeys(r.codec for r in rows):
        mine = [r for r in rows if r.codec == codec]
        out[codec] = {
            "avg_busbw_gbps": sum(r.busbw_gbps for r in mine) / len(mine),
            "avg_effective_busbw_gbps": sum(r.effective_busbw_gbps for r in mine) / len(mine),
        }
        errors = [r.max_rel_error for r in mine if r.max_rel_error is not None]
        if errors:
            out[codec]["max_rel_error"] = max(errors)
    return out


# -- measuring ---------------------------------------------------------------------------------


def _rank_data(torch, count: int, seed: int, rank: int, device):
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    return torch.randn(count, generator=g).to(device)


def _exact_mean(torch, count: int, seed: int, nranks: int):
    total = torch.zeros(count, dtype=torch.float64)
    for r in range(nranks):
        total += _rank_data(torch, count, seed, r, "cpu").double()
    return total / nranks


def measure(
    comm,
    size: int,
    codec_name: str,
    *,
    iters: int,
    warmup: int,
    check: bool,
    algorithm: str = "auto",
    device: str = "cpu",
    seed: int = 0,
) -> Row:
    """Time ``iters`` allreduces of ``size`` fp32 bytes through ``codec_name`` on ``comm``."""
    import torch

    from commopt import collectives
    from commopt.codecs import RngKey, get_codec

    codec = get_codec(codec_name)
    count = size // 4
    flat = _rank_data(torch, count, seed, comm.rank, device)
    step = 0

    def once() -> None:
        nonlocal step
        rng = RngKey(seed, comm.rank, step) if codec.stochastic else None
        collectives.allreduce(
            comm, flat, codec, average=True, algorithm=algorithm, rng=rng, key="bench"
        ).wait()
        if flat.is_cuda:
            torch.cuda.synchronize()
        step += 1

    for _ in range(warmup):
        once()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        once()
    mine = (time.perf_counter() - start) / iters
    seconds = max(comm.allgather_obj(mine))  # the slowest rank sets the pace
    error = None
    if check:
        flat.copy_(_rank_data(torch, count, seed, comm.rank, device))
        once()
        exact = _exact_mean(torch, count, seed, comm.size)
        worst = (flat.double().cpu() - exact).abs().max().item()
        error = worst / max(exact.abs().max().item(), 1e-300)
        error = max(comm.allgather_obj(error))
    return make_row(size, codec_name, codec.encoded_nbytes(count), seconds, comm.size, error)


def run_sweep(
    comm,
    sweep: list[int],
    codecs: list[str],
    *,
    iters: int,
    warmup: int,
    check: bool,
    algorithm: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    on_row=None,
) -> list[Row]:
    rows = []
    for size in sweep:
        for codec in codecs:
            row = measure(
                comm,
                size,
                codec,
                iters=iters,
                warmup=warmup,
                check=check,
                algorithm=algorithm,
                device=device,
                seed=seed,
            )
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


# -- output ------------------------------------------------------------------------------------

_HEADER = (
    f"#{'size':>11} {'count':>11} {'type':>6} {'codec':>8} {'wire(B)':>11} "
    f"{'time(us)':>11} {'algbw':>8} {'busbw':>8} {'effbw':>8} {'error':>9}\n"
    f"#{'(B)':>11} {'(elems)':>11} {'':>6} {'':>8} {'':>11} {'':>11} "
    f"{'(GB/s)':>8} {'(GB/s)':>8} {'(GB/s)':>8} {'':>9}"
)


def format_row(r: Row) -> str:
    err = "n/a" if r.max_rel_error is None else f"{r.max_rel_error:.2e}"
    return (
        f" {r.size:>11} {r.count:>11} {r.type:>6} {r.codec:>8} {r.wire_bytes:>11} "
        f"{r.time_us:>11.1f} {r.algbw_gbps:>8.3f} {r.busbw_gbps:>8.3f} "
        f"{r.effective_busbw_gbps:>8.3f} {err:>9}"
    )


def format_summary(summary: dict) -> str:
    lines = []
    for codec, s in summary.items():
        lines.append(
            f"# Avg bus bandwidth ({codec}): {s['avg_busbw_gbps']:.3f} GB/s "
            f"({s['avg_busbw_gbps'] * 8:.3f} Gbit/s), effective "
            f"{s['avg_effective_busbw_gbps']:.3f} GB/s"
        )
    return "\n".join(lines)


def document(config: dict, rows: list[Row]) -> dict:
    """The --json document: the run's configuration, every row, the summary."""
    return {
        "benchmark": "allreduce",
        "schema": SCHEMA_VERSION,
        **config,
        "results": [asdict(r) for r in rows],
        "summary": summarize(rows),
    }


# -- the command -------------------------------------------------------------------------------


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run (every option spelled out)."""
    return (
        f"commopt bench allreduce -b {args.minbytes} -e {args.maxbytes} "
        f"-f {args.stepfactor} -i {args.stepbytes} -n {args.iters} -w {args.warmup_iters} "
        f"-c {args.check} --comm {args.comm} --codec {args.codec} "
        f"--algorithm {args.algorithm} --device {args.device} --seed {args.seed}"
    )


def _fail(msg: str) -> int:
    print(f"commopt bench allreduce: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        sweep = sizes(
            parse_size(args.minbytes),
            parse_size(args.maxbytes),
            factor=args.stepfactor,
            increment=parse_size(args.stepbytes),
        )
    except ValueError as exc:
        return _fail(str(exc))
    if sweep[0] < 4:
        return _fail("the smallest size is one fp32 element: -b 4 or more")
    if args.iters < 1 or args.warmup_iters < 0:
        return _fail("-n must be at least 1 and -w at least 0")
    codecs = [c.strip() for c in args.codec.split(",") if c.strip()]
    from commopt.codecs import get_codec

    try:
        for c in codecs:
            get_codec(c)
    except ValueError as exc:
        return _fail(str(exc))
    if not codecs:
        return _fail("--codec needs at least one name, e.g. fp32,fp16,qsgd4")
    from commopt.collectives import ALGORITHMS

    if args.algorithm not in ALGORITHMS:
        return _fail(f"unknown --algorithm {args.algorithm!r}; one of {', '.join(ALGORITHMS)}")
    device = args.device
    if device == "auto":
        device = "cuda" if args.comm in ("pure_nccl", "nccl") else "cpu"

    import commopt

    try:
        comm = commopt.create_communicator(args.comm)
    except (ValueError, ImportError) as exc:
        return _fail(str(exc))
    link_bits = int(os.environ.get(LINK_ENV, "0")) or None
    config = {
        "comm": args.comm,
        "link_bits_per_s": link_bits,
        "world_size": comm.size,
        "nodes": comm.inter_size,
        "ranks_per_node": comm.intra_size,
        "device": device,
        "algorithm": args.algorithm,
        "iters": args.iters,
        "warmup": args.warmup_iters,
        "check": bool(args.check),
        "seed": args.seed,
        "command": command_line(args),
    }
    table = comm.rank == 0 and args.json is None
    if comm.size == 1:  # nothing crosses a link: algbw/busbw measure the codec alone, busbw is 0
        print(
            f"commopt bench allreduce: a world of one rank: nothing is sent, so busbw is 0 by "
            f"definition (2(n-1)/n = 0) and the times are the codec's alone. To measure the "
            f"network, launch N ranks: commopt launch -n 2 -- commopt bench allreduce "
            f"--comm {args.comm if args.comm != 'local' else 'torch'}",
            file=sys.stderr,
            flush=True,
        )
    if table:
        print(
            f"# commopt bench allreduce: {comm.size} ranks on {comm.inter_size} nodes, "
            f"comm {args.comm}, device {device}, algorithm {args.algorithm}\n"
            f"#   iters {args.iters}, warm-up {args.warmup_iters}, check "
            f"{'on' if args.check else 'off'}; busbw = wire/time * 2(n-1)/n, "
            f"effbw = fp32 bytes/time * 2(n-1)/n",
            flush=True,
        )
        if link_bits:
            print(
                f"#   links {link_bits / 1e9:g} Gbit/s (emulated): busbw cannot exceed "
                f"{link_bits / 8e9:.3f} GB/s",
                flush=True,
            )
        print(f"#\n{_HEADER}", flush=True)
    rows = run_sweep(
        comm,
        sweep,
        codecs,
        iters=args.iters,
        warmup=args.warmup_iters,
        check=bool(args.check),
        algorithm=args.algorithm,
        device=device,
        seed=args.seed,
        on_row=(lambda r: print(format_row(r), flush=True)) if table else None,
    )
    if comm.rank == 0:
        doc = document(config, rows)
        if table:
            print(format_summary(doc["summary"]))
        elif args.json == "-":
            print(json.dumps(doc, indent=2))
        else:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=2)
                f.write("\n")
    comm.barrier()
    comm.finalize()
    return 0
