"""Where the time of a scatter-reduce/allgather allreduce goes, stage by stage.

    $ commopt launch -n 2 --link 1gbit -- python benchmarks/sra_stages.py --mib 64 --codecs qsgd4,qsgd8

Runs the stages of ``commopt.collectives``' scatter-reduce/allgather one after the other on
the calling thread (as its driver thread does), timing each: encode every peer's chunk,
alltoall, decode-and-add the received chunks, re-encode the reduced chunk, allgather,
decode everything. Rank 0 prints, per codec, the median over ``--reps`` of each stage (the
slowest rank's time, so a stage also absorbs its peer's lateness from the stage before) and
the link's time for the wire bytes of each transfer (bytes crossing one direction / rate).
``--transfers`` also times the alltoall and the allgather of the same wire sizes alone,
with nothing around them (what the transport does with those bytes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import commopt
from commopt.codecs import RngKey, get_codec
from commopt.collectives import chunk_bounds


def stages(comm, flat: torch.Tensor, codec, step: int) -> dict[str, float]:
    size, rank = comm.size, comm.rank
    bounds = chunk_bounds(flat.numel(), size, codec.alignment)
    slot = codec.encoded_nbytes(bounds[0][1] - bounds[0][0])
    rng = RngKey(0, rank, step) if codec.stochastic else None
    send = torch.empty(size * slot, dtype=torch.uint8)
    recv = torch.empty_like(send)
    lo, hi = bounds[rank]
    nbytes = codec.encoded_nbytes(hi - lo)
    out: dict[str, float] = {}
    comm.barrier()
    t = time.perf_counter()

    def tick(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[name] = now - t
        t = now

    for j, (a, b) in enumerate(bounds):
        codec.encode(
            flat[a:b],
            send[j * slot : j * slot + codec.encoded_nbytes(b - a)],
            scale=1.0 / size,
            rng=rng,
        )
    tick("encode")
    comm.alltoall(send, recv)
    tick("alltoall")
    for i in range(size):
        codec.decode(recv[i * slot : i * slot + nbytes], flat[lo:hi], accumulate=i > 0)
    tick("decode+add")
    codec.encode(flat[lo:hi], recv[rank * slot : rank * slot + nbytes], scale=1.0, rng=rng)
    tick("re-encode")
    comm.allgather(recv[rank * slot : (rank + 1) * slot], send)
    tick("allgather")
    for j, (a, b) in enumerate(bounds):
        codec.decode(send[j * slot : j * slot + codec.encoded_nbytes(b - a)], flat[a:b])
    tick("decode")
    out["total"] = sum(out.values())
    return out


def transfers_alone(comm, wire: int, reps: int) -> dict[str, float]:
    """Median time of an alltoall of ``wire`` bytes and an allgather of wire/size per rank."""
    chunk = -(-wire // comm.size)
    send = torch.zeros(chunk * comm.size, dtype=torch.uint8)
    recv = torch.empty_like(send)
    times: dict[str, list[float]] = {"alltoall": [], "allgather": []}
    for step in range(reps + 1):
        for name, fn in (
            ("alltoall", lambda: comm.alltoall(send, recv)),
            ("allgather", lambda: comm.allgather(send[:chunk], recv)),
        ):
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            took = max(comm.allgather_obj(time.perf_counter() - t0))
            if step:
                times[name].append(took)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comm", default="mpi")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--codecs", default="fp16,qsgd4,qsgd8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--transfers", action="store_true", help="also time the alltoall and allgather alone"
    )
    args = ap.parse_args(argv)
    comm = commopt.create_communicator(args.comm)
    rate = int(os.environ.get("COMMOPT_LINK_BITS", "0")) / 8 or None
    for name in args.codecs.split(","):
        codec = get_codec(name)
        flat = torch.randn((args.mib << 20) // 4)
        runs = []
        for step in range(args.reps + 1):
            mine = stages(comm, flat, codec, step)
            everyone = comm.allgather_obj(mine)
            if step:  # the first is a warm-up
                runs.append({k: max(e[k] for e in everyone) for k in mine})
        if comm.rank == 0:
            wire = codec.encoded_nbytes(flat.numel())
            cross = wire * (comm.size - 1) / comm.size  # bytes one rank sends in each phase
            link = f"; link time per transfer {cross / rate * 1e3:.1f} ms" if rate else ""
            print(
                f"{name} {args.mib} MiB (wire {wire} B){link}: "
                + ", ".join(
                    f"{k} {statistics.median(r[k] for r in runs) * 1e3:.0f} ms" for k in runs[0]
                ),
                flush=True,
            )
        if args.transfers:
            alone = transfers_alone(comm, codec.encoded_nbytes(flat.numel()), args.reps)
            if comm.rank == 0:
                print(
                    f"{name} {args.mib} MiB, transfers alone: "
                    + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in alone.items()),
                    flush=True,
                )
    comm.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
