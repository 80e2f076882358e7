"""The one-pass QSGD encode's tile and warps on a GPU, and error feedback's passes.

    python benchmarks/gpu_tile_sweep.py --json gpu-tile-sweep.json

On one 256 MiB float32 buffer (4-bit, 128-wide buckets, max norms): the encode's throughput
for each elements-per-program tile and warp count, stochastic and nearest rounding, and the
time of each pass of an error-feedback encode (add, encode, decode-accumulate, NaN clean-up)
beside a device copy. Times are medians of Triton's ``do_bench``; GB/s of float32 input.
How :data:`commopt.kernels.triton.FUSED_TILE` was chosen (docs/benchmarks-gpu.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TILES = (1024, 2048, 4096, 8192)
WARPS = (2, 4, 8, 16)


def measure(mib: int) -> dict:
    import torch
    from triton.testing import do_bench

    from commopt import kernels
    from commopt.kernels import triton as tk

    numel = mib * 2**20 // 4
    nbytes = numel * 4
    x = torch.randn(numel, device="cuda")
    dst = torch.empty_like(x)

    def gbs(fn) -> float:
        return round(nbytes / do_bench(fn, warmup=10, rep=60, return_mode="median") / 1e6, 1)

    wire = torch.empty(
        kernels.qsgd_nbytes(numel, bits=4, bucket_size=128), dtype=torch.uint8, device="cuda"
    )
    result: dict = {
        "mib": mib,
        "device": torch.cuda.get_device_name(),
        "copy_gbs": gbs(lambda: dst.copy_(x)),
    }
    tile, launch = tk.FUSED_TILE, dict(tk.LAUNCH)
    sweep = {}
    try:
        for stochastic in (True, False):
            for t in TILES:
                for w in WARPS:
                    if w == 16 and t < 4096:
                        continue
                    tk.FUSED_TILE, tk.LAUNCH = t, dict(launch, num_warps=w)

                    def encode(s=stochastic):
                        kernels.qsgd_encode(
                            x,
                            wire,
                            bits=4,
                            levels=7,
                            bucket_size=128,
                            key=(1, 2),
                            stochastic=s,
                            impl="triton",
                        )

                    sweep[f"stochastic={stochastic} tile={t} warps={w}"] = gbs(encode)
    finally:
        tk.FUSED_TILE, tk.LAUNCH = tile, launch
    result["encode_gbs"] = sweep

    from commopt.codecs import RngKey, get_codec

    codec = get_codec("qsgd4")
    r = torch.randn(numel, device="cuda")
    passes = {
        "add": lambda: r.add_(x),
        "encode": lambda: codec.encode(r, wire, rng=RngKey(0, 0, 1), key="b"),
        "decode_accumulate": lambda: codec.decode_scaled(wire, r, accumulate=True, alpha=-1.0),
        "nan_to_num": lambda: torch.nan_to_num_(r, nan=0.0, posinf=0.0, neginf=0.0),
        "copy": lambda: dst.copy_(x),
    }
    result["error_feedback_ms"] = {
        k: round(do_bench(f, warmup=10, rep=60, return_mode="median"), 4) for k, f in passes.items()
    }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_tile_sweep needs a CUDA device (torch.cuda.is_available() is False)")
    from commopt.bench import harness

    result = dict(measure(args.mib), command=harness.command_line(__file__, argv))
    if args.json:
        harness.write_json(args.json, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
