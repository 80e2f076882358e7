"""Codec kernel throughput: native vs plain-torch reference, against memcpy of the same buffer.

Measures, in one run and on one buffer of float32 gradients, the encode and decode
throughput (GB/s of float32 input) of every codec's kernels, next to the memcpy bandwidth
of that buffer (``dst.copy_(src)``, the physical limit the issue's targets are stated in),
on one core (``--threads 1``, the default) or more. Also prints the wire size of each codec
relative to float32. With a CUDA device (and CuPy) it measures the CUDA kernels against a
device-to-device copy of the same buffer.

    python benchmarks/codec_perf.py                 # 64 MiB buffer, one core
    python benchmarks/codec_perf.py --mib 16 --threads 2 --json out.json

Targets: QSGD 4-bit/128 wire <= 0.14 of fp32; native QSGD encode and decode each
>= 10x the reference and >= 15% of memcpy on one core; CUDA encode >= 60% of device memory
bandwidth.
"""

from __future__ import annotations

import argparse

import torch

from commopt import kernels
from commopt.bench.harness import (
    best_seconds,
    cpu_model,
    interleaved_best,
    table,
    write_json,
)
from commopt.codecs import get_codec

QSGD_CASES = [  # (label, bits, bucket, norm, stochastic)
    ("qsgd4 b128 max stochastic", 4, 128, "max", True),
    ("qsgd2 b128 max stochastic", 2, 128, "max", True),
    ("qsgd8 b128 max stochastic", 8, 128, "max", True),
    ("qsgd4 b128 l2 stochastic", 4, 128, "l2", True),
    ("qsgd4 b128 max nearest", 4, 128, "max", False),
]
CAST_CASES = [("fp16", torch.float16), ("bf16", torch.bfloat16)]


def qsgd_calls(x, wire, out, bits: int, bucket: int, norm: str, stochastic: bool, **extra):
    """One QSGD case's timed calls: encode ``x`` into ``wire``, decode it onto ``out``."""
    shape = dict(bits=bits, levels=2 ** (bits - 1) - 1, bucket_size=bucket, **extra)
    return (
        lambda: kernels.qsgd_encode(x, wire, key=(1, 2), norm=norm, stochastic=stochastic, **shape),
        lambda: kernels.qsgd_decode(wire, out, accumulate=True, **shape),
    )


def run_cpu(numel: int, threads: int, reps: int, ref_reps: int) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    gb = numel * 4 / 1e9
    dst = torch.empty_like(x)
    native = kernels.native_available()
    rows = []

    def measure(label, wire_ratio, native_fns, reference_fns):
        fns = {"memcpy": lambda: dst.copy_(x)}
        if native:
            fns.update(native_fns)
        best = interleaved_best(fns, reps)
        best.update({k: best_seconds(f, ref_reps) for k, f in reference_fns.items()})
        row = {"codec": label, "wire_ratio": wire_ratio}
        row.update({k: gb / v for k, v in best.items()})
        rows.append(row)

    for label, bits, bucket, norm, stochastic in QSGD_CASES:
        wire = torch.empty(
            kernels.qsgd_nbytes(numel, bits=bits, bucket_size=bucket), dtype=torch.uint8
        )
        case = (x, wire, torch.zeros(numel), bits, bucket, norm, stochastic)
        native_enc, native_dec = qsgd_calls(*case, impl="native", threads=threads)
        ref_enc, ref_dec = qsgd_calls(*case, impl="reference")
        measure(
            label,
            wire.numel() / (numel * 4),
            {"native_encode": native_enc, "native_decode": native_dec},
            {"reference_encode": ref_enc, "reference_decode": ref_dec},
        )
    for label, dtype in CAST_CASES:
        wire = torch.empty(numel, dtype=dtype)
        out = torch.zeros(numel)

        def cenc(impl, **extra):
            return lambda: kernels.cast_encode(x, wire, scale=0.125, impl=impl, **extra)

        def cdec(impl, **extra):
            return lambda: kernels.cast_decode(wire, out, accumulate=True, impl=impl, **extra)

        measure(
            label,
            wire.element_size() / 4,
            {
                "native_encode": cenc("native", threads=threads),
                "native_decode": cdec("native", threads=threads),
            },
            {"reference_encode": cenc("reference"), "reference_decode": cdec("reference")},
        )
    return {"device": cpu_model(), "threads": threads, "numel": numel, "rows": rows}


def run_cuda(numel: int, reps: int) -> dict | None:
    if not torch.cuda.is_available():
        return None
    # CUDA tensors go to the Triton kernels, which come with CUDA builds of torch.
    x = torch.randn(numel, device="cuda")
    gb = numel * 4 / 1e9
    dst = torch.empty_like(x)
    sync = torch.cuda.synchronize
    # a copy reads and writes every byte: device bandwidth = 2 * bytes / time
    copy_s = best_seconds(lambda: dst.copy_(x), reps, sync=sync)
    rows = []
    for label, bits, bucket, norm, stochastic in QSGD_CASES:
        wire = torch.empty(
            kernels.qsgd_nbytes(numel, bits=bits, bucket_size=bucket),
            dtype=torch.uint8,
            device="cuda",
        )
        out = torch.zeros(numel, device="cuda")
        encode, decode = qsgd_calls(x, wire, out, bits, bucket, norm, stochastic)
        enc = best_seconds(encode, reps, sync=sync)
        dec = best_seconds(decode, reps, sync=sync)
        # bytes the encode must move: read x, write the wire
        rows.append(
            {
                "codec": label,
                "encode": gb / enc,
                "decode": gb / dec,
                "encode_bytes_moved_GBps": (numel * 4 + wire.numel()) / enc / 1e9,
            }
        )
    return {
        "device": torch.cuda.get_device_name(),
        "numel": numel,
        "device_bandwidth_GBps": 2 * gb / copy_s,
        "rows": rows,
    }


def render(cpu: dict, cuda: dict | None) -> str:
    lines = [
        f"CPU: {cpu['device']}, threads={cpu['threads']}, buffer {cpu['numel'] * 4 / 2**20:.0f} MiB fp32",
        "memcpy: dst.copy_(src) of the same buffer, timed in alternation with each native kernel",
        "",
    ]
    body = []
    for r in cpu["rows"]:
        mc, ne, re_, nd, rd = (
            r.get(k, float("nan"))
            for k in (
                "memcpy",
                "native_encode",
                "reference_encode",
                "native_decode",
                "reference_decode",
            )
        )
        body.append(
            [
                r["codec"],
                f"{r['wire_ratio']:.4f}",
                f"{mc:.2f}",
                f"{ne:.2f}",
                f"{re_:.3f}",
                f"{ne / re_:.0f}x",
                f"{ne / mc:.0%}",
                f"{nd:.2f}",
                f"{rd:.3f}",
                f"{nd / rd:.0f}x",
                f"{nd / mc:.0%}",
            ]
        )
    head = [
        "codec",
        "wire / fp32",
        "memcpy GB/s",
        "native enc GB/s",
        "ref enc GB/s",
        "enc x ref",
        "enc / memcpy",
        "native dec GB/s",
        "ref dec GB/s",
        "dec x ref",
        "dec / memcpy",
    ]
    lines.append(table(head, body, markdown=True, align="l" * len(head)))
    q4 = cpu["rows"][0]
    mc = q4["memcpy"]
    checks = [
        ("QSGD 4-bit/128 wire <= 0.14 of fp32", q4["wire_ratio"] <= 0.14),
        (
            "native QSGD4 encode >= 10x reference",
            q4.get("native_encode", 0) >= 10 * q4["reference_encode"],
        ),
        (
            "native QSGD4 decode >= 10x reference",
            q4.get("native_decode", 0) >= 10 * q4["reference_decode"],
        ),
        ("native QSGD4 encode >= 15% of memcpy", q4.get("native_encode", 0) >= 0.15 * mc),
        ("native QSGD4 decode >= 15% of memcpy", q4.get("native_decode", 0) >= 0.15 * mc),
    ]
    lines.append("")
    lines += [f"- {name}: {'met' if ok else 'NOT met'}" for name, ok in checks]
    lines.append("")
    if cuda is None:
        lines.append("CUDA: no GPU on this machine; CUDA throughput not measured.")
    elif "skipped" in cuda:
        lines.append(f"CUDA: {cuda['skipped']}")
    else:
        bw = cuda["device_bandwidth_GBps"]
        lines.append(f"CUDA: {cuda['device']}, device copy bandwidth {bw:.0f} GB/s")
        lines.append(
            table(
                ["codec", "encode GB/s", "encode / bandwidth", "decode GB/s"],
                [
                    [
                        r["codec"],
                        f"{r['encode']:.0f}",
                        f"{r['encode'] / bw:.0%}",
                        f"{r['decode']:.0f}",
                    ]
                    for r in cuda["rows"]
                ],
                markdown=True,
                align="llll",
            )
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mib", type=float, default=64, help="buffer size in MiB of float32 (default 64)"
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: one core)")
    parser.add_argument(
        "--reps", type=int, default=5, help="repetitions, best kept (native, memcpy)"
    )
    parser.add_argument("--ref-reps", type=int, default=2, help="repetitions of the slow reference")
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args(argv)
    numel = int(args.mib * 2**20) // 4
    cpu = run_cpu(numel, args.threads, args.reps, args.ref_reps)
    cuda = run_cuda(numel, args.reps)
    print(render(cpu, cuda))
    if args.json:
        codecs = ("none", "fp16", "qsgd2", "qsgd4", "qsgd8")
        ratios = {n: get_codec(n).encoded_nbytes(numel) / (4 * numel) for n in codecs}
        write_json(args.json, {"cpu": cpu, "cuda": cuda, "codecs": ratios}, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
