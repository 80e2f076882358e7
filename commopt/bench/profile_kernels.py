"""Micro benchmark: packing a bucket and checking it for NaN/Inf, two passes against one.

Before (what a reducer does with torch ops): copy each gradient into its slot of the bucket,
then ``torch.isfinite(flat.sum())``: the data is read twice. After: the native
``kernels.pack_nonfinite``, one pass. Likewise the check alone after the reduction:
``torch.isfinite(flat.sum())`` against ``kernels.nonfinite``. Beside them, the physical limit
on this machine: a plain ``copy_`` of the same bytes (one read and one write) and a plain read
(``flat.max()``). Every variant runs in turn, repeated, so load changes hit all alike.

    python -m commopt.bench.profile_kernels --json benchmarks/results/profile-kernels.json

    >>> out = run([(64, 32), (64,)], repeats=1, threads=1)
    >>> out["numel"], sorted(out["median_s"])[0]
    (2112, 'check limit: flat.max() (one read)')
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def mlp_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of the step benchmark's MLP (25.2M parameters)."""
    from commopt.bench.step.models import MODELS, param_shapes

    return param_shapes(MODELS["mlp"].build())


def _time_once(fn) -> list[float]:
    start = time.perf_counter()
    fn()
    return [time.perf_counter() - start]


def run(shapes, repeats: int, threads: int) -> dict:
    """Median seconds of each variant over ``repeats`` interleaved rounds."""
    import torch

    from commopt import kernels

    torch.set_num_threads(threads)
    grads = [torch.randn(s) for s in shapes]
    numel = sum(g.numel() for g in grads)
    flat = torch.empty(numel)
    pieces, offset = [], 0
    for g in grads:
        pieces.append((g.reshape(-1), offset, g.numel()))
        offset += g.numel()

    def pack_two_passes():
        for src, off, n in pieces:
            flat[off : off + n].copy_(src)
        return not bool(torch.isfinite(flat.sum()))

    variants = {
        "pack: copy_ per slot, then isfinite(sum) [before]": pack_two_passes,
        "pack: native pack_nonfinite [after]": lambda: kernels.pack_nonfinite(
            pieces, flat, threads=threads
        ),
        "pack limit: copy_ per slot only": lambda: [flat[o : o + n].copy_(s) for s, o, n in pieces],
        "check: isfinite(flat.sum()) [before]": lambda: not bool(torch.isfinite(flat.sum())),
        "check: isfinite(flat).all() [exact, torch]": lambda: not bool(torch.isfinite(flat).all()),
        "check: native nonfinite [after]": lambda: kernels.nonfinite(flat, threads=threads),
        "check limit: flat.max() (one read)": lambda: flat.max(),
    }
    for fn in variants.values():  # warm-up: page in, load the library
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name] += _time_once(fn)
    return {
        "numel": numel,
        "bytes": 4 * numel,
        "threads": threads,
        "repeats": repeats,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "min_s": {k: min(v) for k, v in times.items()},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="kernel and torch threads (default 1: the step benchmark's per rank)",
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    out = run(mlp_shapes(), args.repeats, args.threads)
    out.update(
        command="python -m commopt.bench.profile_kernels " + " ".join(argv or []),
        load_average_start=load,
        load_average_end=os.getloadavg()[0],
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
    gb = out["bytes"] / 1e9
    print(
        f"{out['numel'] / 1e6:.1f}M float32 ({out['bytes'] / 1e6:.1f} MB), {args.threads} thread(s), "
        f"median of {args.repeats}; load average {load:.1f}"
    )
    for name, s in out["median_s"].items():
        print(f"  {name:<52} {s * 1e3:7.2f} ms  {gb / s:6.1f} GB/s read")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
