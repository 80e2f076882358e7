"""Allreduce through every communicator available here, with its timing.

    $ commopt launch -n 2 -- python -m commopt.examples.allreduce_tour --mib 16

Each rank sums a buffer of rank-dependent values through each transport and checks the
result exactly; rank 0 prints time, bus bandwidth (nccl-tests convention: busbw = bytes /
time x 2(n-1)/n) and whether the sum was right.
"""

from __future__ import annotations

import argparse
import time

import torch

import commopt
from commopt.tables import table

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _available(names):
    comms = []
    for name in names:
        try:
            comms.append(commopt.create_communicator(name))
        except (ImportError, RuntimeError) as exc:
            comms.append((name, str(exc).splitlines()[0]))
    return comms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=16, help="buffer size in MiB of fp32")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--comms", default="mpi,torch,pure_nccl,horovod,local")
    args = parser.parse_args(argv)

    numel = int(args.mib * 2**20 / 4)
    from commopt.comm.launcher import detect_launcher

    world_rank = detect_launcher().rank
    rows = []
    for comm in _available(args.comms.split(",")):
        if isinstance(comm, tuple):
            rows.append((comm[0], "-", "-", "-", "-", f"skipped: {comm[1]}"))
            continue
        n, r = comm.size, comm.rank
        for tag, dtype in DTYPES.items():
            # Values (i % 5 + 1) * (rank + 1): the sum is exact in every dtype.
            base = (torch.arange(numel) % 5 + 1).to(dtype)
            expected = base * (n * (n + 1) // 2)
            buf = base * (r + 1)
            comm.allreduce(buf.clone())  # warm-up
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                buf.copy_(base * (r + 1))
                comm.allreduce(buf)
            dt = (time.perf_counter() - t0) / args.iters
            nbytes = numel * buf.element_size()
            busbw = nbytes / dt * (2 * (n - 1) / n) / 1e9 if n > 1 else float("nan")
            ok = torch.equal(buf, expected)
            rows.append(
                (
                    comm.name,
                    n,
                    tag,
                    f"{nbytes / 2**20:.1f}",
                    f"{dt * 1e3:.1f}",
                    f"{busbw:.2f} GB/s busbw, {'correct' if ok else 'WRONG SUM'}",
                )
            )
            if not ok:
                raise SystemExit(f"rank {r}: {comm.name} {tag} allreduce gave a wrong sum")
    if world_rank == 0:
        print(
            table(["communicator", "ranks", "dtype", "MiB", "ms", "result"], rows, align="lrrrrl")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
