"""Bare mpi4py transfers between 2 ranks, to see what Open MPI's TCP transport makes of a link.

    $ commopt launch -n 2 --link 1gbit -- python benchmarks/mpi_tcp_diag.py --mib 64
    $ OMPI_MCA_btl_tcp_links=2 commopt launch -n 2 --link 1gbit -- \\
          python benchmarks/mpi_tcp_diag.py --tests exchange --mib 64
    $ commopt launch -n 2 --link 1gbit -- python benchmarks/mpi_tcp_diag.py --tests timeline

Tests (each repeated ``--reps`` times; rank 0 prints every time, the median and the median
over the link's time for the bytes that cross one direction, ``bytes / rate``, with the rate
from COMMOPT_LINK_BITS):

- ``oneway``: rank 0 MPI_Send, rank 1 MPI_Recv of the whole buffer (one direction);
- ``exchange``: MPI_Sendrecv of the whole buffer (both directions at once);
- ``allreduce``: MPI_Allreduce of the buffer (fp32 sum), Open MPI's choice of algorithm;
- ``chunked:KIB``: both ranks post Irecv/Isend of the buffer in KIB-KiB messages, then wait
  (spinning in MPI_Waitall, or polling with sleeps: ``--poll-sleep-us``);
- ``timeline``: Irecv + Isend of the whole buffer, polled: when each rank's receive and send
  completed. If the two directions share the link, all four times are about bytes / rate;
  if one direction waits for the other, one pair is twice that;
- ``tcp``: no MPI on the data path: one plain TCP connection between the ranks (rank 0's
  host name, which the emulated cluster resolves to its data address), each rank sending
  the buffer from one thread while receiving from another: what the link and the kernel
  give both directions at once.

It imports nothing from commopt, so the same numbers come from any mpirun.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="buffer size in MiB (default 64)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tests", default="oneway,exchange,allreduce,chunked:1024,timeline")
    ap.add_argument(
        "--poll-sleep-us",
        type=float,
        default=0,
        help="chunked: wait by polling with sleeps of this many us (default 0: "
        "MPI_Waitall, which spins)",
    )
    args = ap.parse_args(argv)
    # Here, not at the top: importing mpi4py starts MPI, and pytest imports this file for
    # its doctests (an MPI singleton in pytest's process breaks every later mpirun).
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != 2:
        print("run with exactly 2 ranks (commopt launch -n 2 ...)", file=sys.stderr)
        return 2
    peer = 1 - rank
    nbytes = args.mib << 20
    rate = int(os.environ.get("COMMOPT_LINK_BITS", "0")) / 8 or None
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    comm.Sendrecv(a[:1024], peer, recvbuf=b[:1024], source=peer)  # connect first

    def timed(fn) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        mine = np.array([time.perf_counter() - t0])
        everyone = np.empty(comm.Get_size())
        comm.Allgather(mine, everyone)  # buffers, not mpi4py's pickling allgather
        return float(everyone.max())

    for test in args.tests.split(","):
        if test == "tcp":
            fn = _tcp_exchange(comm, a, b)
            times = [timed(fn) for _ in range(args.reps)]
            _report(rank, test, args.mib, times, nbytes, rate)
            continue
        if test == "timeline":
            for rep in range(args.reps):
                comm.Barrier()
                t0 = time.perf_counter()
                reqs = {"recv": comm.Irecv(b, peer), "send": comm.Isend(a, peer)}
                done: dict[str, float] = {}
                while len(done) < 2:
                    for k, req in reqs.items():
                        if k not in done and req.Test():
                            done[k] = time.perf_counter() - t0
                everyone = comm.gather(done)
                if rank == 0:
                    print(
                        f"timeline {args.mib} MiB rep {rep}: "
                        + "; ".join(
                            f"rank {r} received at {d['recv'] * 1e3:.0f} ms, sent at {d['send'] * 1e3:.0f} ms"
                            for r, d in enumerate(everyone)
                        ),
                        flush=True,
                    )
            continue
        if test == "oneway":
            fn = (lambda: comm.Send(a, peer)) if rank == 0 else (lambda: comm.Recv(b, peer))
        elif test == "exchange":

            def fn():
                comm.Sendrecv(a, peer, recvbuf=b, source=peer)
        elif test == "allreduce":

            def fn():
                comm.Allreduce(MPI.IN_PLACE, a)
        elif test.startswith("chunked:"):
            seg = int(test.split(":")[1]) * 256  # KiB -> fp32 elements

            def fn():
                reqs = [comm.Irecv(b[lo : lo + seg], peer, 7) for lo in range(0, a.size, seg)]
                reqs += [comm.Isend(a[lo : lo + seg], peer, 7) for lo in range(0, a.size, seg)]
                if args.poll_sleep_us <= 0:
                    MPI.Request.Waitall(reqs)
                    return
                for req in reqs:
                    while not req.Test():
                        time.sleep(args.poll_sleep_us * 1e-6)
        else:
            print(f"unknown test {test!r}", file=sys.stderr)
            return 2
        times = [timed(fn) for _ in range(args.reps)]
        _report(rank, test, args.mib, times, nbytes, rate)
    return 0


def _report(rank, test, mib, times, nbytes, rate) -> None:
    if rank == 0:
        med = statistics.median(times)
        limit = (
            f"; link time {nbytes / rate * 1e3:.0f} ms, median x{med / (nbytes / rate):.2f}"
            if rate
            else ""
        )
        print(
            f"{test} {mib} MiB: "
            + " ".join(f"{t * 1e3:.0f}" for t in times)
            + f" ms; median {med * 1e3:.0f} ms{limit}",
            flush=True,
        )


def _bcast_address(comm, addr):
    """Rank 0's (host, port) on every rank, as a fixed 256-byte buffer (never pickle)."""
    buf = bytearray(256)
    if addr is not None:
        text = f"{addr[0]} {addr[1]}".encode()
        buf[: len(text)] = text
    comm.Bcast(buf, root=0)
    host, port = bytes(buf).rstrip(b"\0").decode().split()
    return host, int(port)


def _tcp_exchange(comm, a: np.ndarray, b: np.ndarray):
    """Connect rank 1 to rank 0 over plain TCP; return a function that swaps a into the peer's b."""
    rank = comm.Get_rank()
    if rank == 0:
        listener = socket.socket()
        listener.bind((socket.gethostbyname(socket.gethostname()), 0))
        listener.listen(1)
        _bcast_address(comm, listener.getsockname())
        conn = listener.accept()[0]
        listener.close()
    else:
        conn = socket.create_connection(_bcast_address(comm, None))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, into = memoryview(a).cast("B"), memoryview(b).cast("B")

    def receive() -> None:
        got = 0
        while got < len(into):
            n = conn.recv_into(into[got:])
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n

    def exchange() -> None:
        sender = threading.Thread(target=conn.sendall, args=(out,))
        sender.start()
        receive()
        sender.join()

    return exchange


if __name__ == "__main__":
    sys.exit(main())
