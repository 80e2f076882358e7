"""GPU benchmarks: codec kernels against a device copy, NCCL allreduce against torch's.

    python benchmarks/gpu_bench.py --json gpu-bench.json --report gpu-bench.md
    python benchmarks/gpu_bench.py --from gpu-bench.json --report gpu-bench.md

Measured in one run, on one buffer of ``--mib`` MiB of float32 on one device:

- codecs: encode and decode (fused accumulate) throughput of every codec's GPU kernels, in
  GB/s of float32 input, beside a device-to-device copy of the same buffer
  (``dst.copy_(src)``; the physical limit: a copy moves the bytes once each way);
- allreduce: ``torch.distributed`` with the nccl backend, commopt's ``pure_nccl``
  communicator on the raw buffer, and ``commopt.collectives.allreduce`` through every codec
  (``algorithm="scatter_reduce"``, so the codec runs even in a world of one). In a world of
  one no byte crosses a link: the figures measure each path's overhead only.

Targets: codec encode >= 70% of the copy's bandwidth at 64 MiB; ``pure_nccl``
allreduce no slower than torch.distributed's nccl allreduce of the same buffer. A codec's and
the copy's device times are the median of Triton's ``do_bench`` (calls queued back to back,
the L2 cache flushed before each, CUDA events): the kernels' own throughput. Beside them, a
call launched alone (best of ``--reps``, the host's launch included): what one call costs
when nothing else is queued. ``limit`` is the encode's best possible share of the copy if
both ran at the same memory bandwidth: the copy moves 8 bytes per element, an encode reads 4
and writes its wire, error feedback also reads and writes the residual. The device check
(``python3 -m commopt.gpu_check``, whose report is docs/benchmarks-gpu.md) runs
:func:`measure_codecs`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

CODECS = [
    "none",
    "fp16",
    "bf16",
    "qsgd8",
    "qsgd4",
    "qsgd2",
    "qsgd4-l2",
    "qsgd4-nearest",
    "qsgd4+ef",
]
ENCODE_TARGET = 0.70  # of the copy bandwidth


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mib", type=float, default=64.0, help="buffer size in MiB of float32 (default 64)"
    )
    p.add_argument("--reps", type=int, default=20, help="timed repetitions; the best is kept")
    p.add_argument("--json", type=Path, help="write the measurements here")
    p.add_argument("--report", type=Path, help="write the markdown report here")
    p.add_argument(
        "--from",
        dest="from_json",
        type=Path,
        help="render --report from this JSON, measure nothing",
    )
    p.add_argument("--no-allreduce", action="store_true", help="codec kernels only")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.reps < 1:
        p.error("--mib must be > 0 and --reps >= 1")
    if args.from_json is not None and args.report is None:
        p.error("--from needs --report (the file to write)")
    return args


def make_codec(name: str):
    """The codec a row of the report names (two QSGD variants beside the registry's names)."""
    from commopt.codecs import QSGD, get_codec

    if name == "qsgd4-l2":
        return QSGD(4, 128, "l2")
    if name == "qsgd4-nearest":
        return QSGD(4, 128, stochastic=False)
    return get_codec(name)


def _best_ms(fn, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _device_ms(fn, reps: int) -> float:
    """The median device time of ``fn`` with calls queued back to back (Triton's do_bench,
    which flushes the L2 cache before each); without Triton, the best call launched alone."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _best_ms(fn, reps)
    return float(do_bench(fn, warmup=10, rep=max(25, 5 * reps), return_mode="median"))


def encode_limit(wire_ratio: float, error_feedback: bool) -> float:
    """The encode's best share of the copy's input bandwidth at equal memory bandwidth.

    >>> round(encode_limit(0.125, False), 2)  # fp32 in, 4 bits out: 4.5 bytes per element
    1.78
    >>> round(encode_limit(0.125, True), 2)  # and the residual read and written: 12.5
    0.64
    """
    moved = 4.0 + 4.0 * wire_ratio + (8.0 if error_feedback else 0.0)
    return 8.0 / moved


def measure_codecs(numel: int, reps: int) -> dict:
    import torch

    from commopt.codecs import RngKey

    x = torch.randn(numel, device="cuda")
    nbytes = numel * 4
    dst = torch.empty_like(x)
    copy_ms = _device_ms(lambda: dst.copy_(x), reps)
    rows = []
    for name in CODECS:
        codec = make_codec(name)
        wire = torch.empty(codec.encoded_nbytes(numel), dtype=torch.uint8, device="cuda")
        step = iter(range(10**9))

        def encode(c=codec, w=wire, s=step):
            c.encode(x, w, rng=RngKey(0, 0, next(s)), key="b")

        enc_ms = _device_ms(encode, reps)
        alone_ms = _best_ms(encode, reps)
        out = torch.zeros_like(x)
        dec_ms = _device_ms(lambda c=codec, w=wire, o=out: c.decode(w, o, accumulate=True), reps)
        ratio = codec.encoded_nbytes(numel) / nbytes
        rows.append(
            {
                "codec": name,
                "encode_ms": enc_ms,
                "encode_alone_ms": alone_ms,
                "decode_ms": dec_ms,
                "encode_gbs": nbytes / enc_ms / 1e6,
                "encode_alone_gbs": nbytes / alone_ms / 1e6,
                "decode_gbs": nbytes / dec_ms / 1e6,
                "wire_ratio": ratio,
                "limit": encode_limit(ratio, name.endswith("+ef")),
            }
        )
    return {
        "copy_ms": copy_ms,
        "copy_gbs": nbytes / copy_ms / 1e6,
        "timing": "median of triton.testing.do_bench"
        if _has_triton()
        else "best of the calls launched alone",
        "rows": rows,
    }


def _has_triton() -> bool:
    try:
        import triton.testing  # noqa: F401
    except ImportError:
        return False
    return True


def measure_allreduce(numel: int, reps: int) -> dict:
    import socket

    import torch
    import torch.distributed as dist

    import commopt
    from commopt import collectives
    from commopt.codecs import RngKey

    x = torch.randn(numel, device="cuda")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch_ms = _best_ms(lambda: dist.all_reduce(x), reps)
    finally:
        dist.destroy_process_group()
    comm = commopt.create_communicator("pure_nccl")
    try:
        raw_ms = _best_ms(lambda: comm.allreduce(x), reps)
        rows = []
        for name in CODECS:
            codec = make_codec(name)
            step = iter(range(10**9))
            ms = _best_ms(
                lambda c=codec, s=step: collectives.allreduce(
                    comm, x, c, algorithm="scatter_reduce", rng=RngKey(0, 0, next(s)), key="b"
                ),
                reps,
            )
            rows.append({"codec": name, "ms": ms})
    finally:
        comm.finalize()
    return {"world_size": 1, "torch_nccl_ms": torch_ms, "pure_nccl_ms": raw_ms, "rows": rows}


def measure(args: argparse.Namespace) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs a CUDA device (torch.cuda.is_available() is False)")
    numel = int(args.mib * 2**20) // 4
    result = {
        "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or torch.version.hip,
        "host": platform.node(),
        "mib": args.mib,
        "numel": numel,
        "reps": args.reps,
        "codecs": measure_codecs(numel, args.reps),
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    if not args.no_allreduce:
        result["allreduce"] = measure_allreduce(numel, args.reps)
    return result


def codec_table(sizes: list[dict]) -> list[str]:
    """Markdown rows of :func:`measure_codecs` results (one per buffer size, ``mib`` optional).

    ``limit``: the encode's best share of the copy at equal memory bandwidth; ``alone``: one
    call launched with nothing queued (the host's launch included)."""
    lines = [
        "| MiB | codec | wire / fp32 | encode GB/s | encode / copy | limit | alone GB/s | "
        "decode+accumulate GB/s | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        mib = f"{size['mib']:g}" if "mib" in size else "-"
        lines.append(f"| {mib} | copy | - | {size['copy_gbs']:.1f} | 100% | - | - | - | - |")
        for r in size["rows"]:
            share = r["encode_gbs"] / size["copy_gbs"]
            limit = f"{r['limit']:.0%}" if "limit" in r else "-"
            alone = f"{r['encode_alone_gbs']:.1f}" if "encode_alone_gbs" in r else "-"
            lines.append(
                f"| {mib} | {r['codec']} | {r['wire_ratio']:.3f} | {r['encode_gbs']:.1f} | "
                f"{share:.0%} | {limit} | {alone} | {r['decode_gbs']:.1f} | "
                f"{'met' if share >= ENCODE_TARGET else 'missed'} |"
            )
    return lines


def render(result: dict) -> str:
    """The markdown report of one result (the JSON ``measure`` writes)."""
    c = result["codecs"]
    lines = [
        "# GPU benchmarks",
        "",
        f"Device: {result['device']} (torch {result['torch']}, CUDA/HIP {result['cuda']}, "
        f"triton {result.get('triton', '?')}); buffer {result['mib']:g} MiB of float32, "
        f"best of {result['reps']}. Command: `{result['command']}`.",
        "",
        "## Codec kernels",
        "",
        f"Physical limit: a device-to-device copy of the same buffer, {c['copy_gbs']:.1f} GB/s "
        f"({c['copy_ms']:.3f} ms; {c.get('timing', 'best of the calls launched alone')}). "
        f"Target: encode >= {ENCODE_TARGET:.0%} of it. GB/s of float32 input.",
        "",
        *codec_table([c]),
    ]
    a = result.get("allreduce")
    if a:
        ok = a["pure_nccl_ms"] <= a["torch_nccl_ms"]
        lines += [
            "",
            "## Allreduce",
            "",
            f"World of {a['world_size']}: no byte crosses a link, so these times are each path's "
            "overhead only. Target: pure_nccl no slower than torch.distributed (nccl) on the "
            f"same buffer: {'met' if ok else 'missed'}.",
            "",
            "| path | ms |",
            "|---|---|",
            f"| torch.distributed nccl all_reduce | {a['torch_nccl_ms']:.3f} |",
            f"| commopt pure_nccl allreduce | {a['pure_nccl_ms']:.3f} |",
        ]
        for r in a["rows"]:
            lines.append(
                f"| collectives.allreduce, {r['codec']} (scatter_reduce) | {r['ms']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
    else:
        result = measure(args)
        text = json.dumps(result, indent=1)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text + "\n")
        else:
            print(text)
    report = render(result)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(report)
    else:
        print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
