"""Piece size of the pipelined scatter-reduce/allgather, side by side, on the running ranks.

Reduces the same gradient size (default 96 MiB of fp32, the step benchmark's model) as one
buffer and as several buckets issued back to back (as the optimizer issues them), with
each piece size in turn, and prints the median time of each next to the wire time of the
codec's bytes (2(n-1)/n x wire bytes / link rate, when ``--link-gbit`` is given):

    commopt launch -n 2 --link 1gbit --launcher torch -- \\
        python benchmarks/sra_pieces.py --comm torch --mib 96 --buckets 1,4 --pieces 4,8,16

Rounds run every combination in turn, so load from other jobs falls on all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comm", default="torch", help="communicator (torch, mpi)")
    parser.add_argument("--codec", default="qsgd4")
    parser.add_argument("--mib", type=float, default=96.0, help="fp32 MiB in all buckets together")
    parser.add_argument("--buckets", default="1,4", help="comma list: how many buckets")
    parser.add_argument("--pieces", default="4,8,16", help="comma list: piece sizes in MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--link-gbit", type=float, default=None, help="link rate for the limit column"
    )
    args = parser.parse_args(argv)

    import torch

    import commopt
    from commopt import collectives
    from commopt.bench import harness
    from commopt.codecs import RngKey, get_codec

    torch.set_num_threads(1)
    comm = commopt.create_communicator(args.comm)
    codec = get_codec(args.codec)
    total = int(args.mib * 2**20) // 4
    combos = [
        (int(b), int(float(p) * 2**20))
        for b in args.buckets.split(",")
        for p in args.pieces.split(",")
    ]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in combos}
    step = 0
    for _ in range(args.rounds):
        for buckets, piece in combos:
            bufs = [torch.randn(total // buckets) for _ in range(buckets)]

            def once() -> None:
                nonlocal step
                step += 1
                works = [
                    collectives.allreduce(
                        comm,
                        b,
                        codec,
                        async_op=True,
                        piece_bytes=piece,
                        rng=RngKey(0, comm.rank, step, k),
                    )
                    for k, b in enumerate(bufs)
                ]
                for w in works:
                    w.wait()

            once()  # warm-up
            comm.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                once()
            times[(buckets, piece)].append((time.perf_counter() - start) / args.iters)
    if comm.rank == 0:
        wire = codec.encoded_nbytes(total)
        limit = ""
        if args.link_gbit:
            limit_s = 2 * (comm.size - 1) / comm.size * wire * 8 / (args.link_gbit * 1e9)
            limit = f"; wire time at {args.link_gbit:g} Gbit/s: {limit_s * 1e3:.1f} ms"
        print(
            f"# {args.codec}, {args.mib:g} MiB of fp32 ({wire / 2**20:.2f} MiB of wire), "
            f"{comm.size} ranks, comm {args.comm}{limit}"
        )
        rows = [
            [
                str(buckets),
                f"{piece / 2**20:g}",
                f"{statistics.median(ts) * 1e3:.1f}",
                ", ".join(f"{t * 1e3:.1f}" for t in ts),
            ]
            for (buckets, piece), ts in times.items()
        ]
        print(harness.table(["buckets", "piece MiB", "median ms", "rounds ms"], rows, align="rrrl"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
