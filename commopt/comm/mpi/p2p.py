"""Collectives as pipelined point-to-point transfers: the segmented ring allreduce and the
pairwise alltoall/allgather, and the polling wait they all use.

Segments no larger than the transport's eager limit need no rendezvous handshake, and many
in flight keep both directions of every link busy (see :mod:`commopt.comm.mpi`).

    >>> from commopt.comm.mpi.p2p import _block_bounds, _segments
    >>> _block_bounds(10, 3), _segments(0, 5, 2)
    ([(0, 4), (4, 8), (8, 10)], [(0, 2), (2, 4), (4, 5)])
"""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import torch

from commopt.comm.mpi.runtime import numpy_view
from commopt.comm.mpi.settings import wait_settings
from commopt.comm.timeout import ProgressWatch

__all__ = ["direct_allgather", "pairwise_alltoall", "ring_allreduce", "wait_polled"]

# Tag bases: each pipelined operation uses its own range of point-to-point tags (MPI keeps
# them apart from the collectives' traffic on the same communicator).
_TAG_ALLTOALL, _TAG_ALLGATHER, _TAG_RING = 1, 2, 16  # the ring uses _TAG_RING + step


#: How the worker waits (commopt.comm.mpi.settings.wait_settings). Waiting in MPI_Wait spins
#: a core: on a busy host a spinning rank loses its turn (and on the emulated cluster it
#: takes the core its peer needs), and while it spins it takes the core from the training
#: thread it should overlap with. Polling with short sleeps costs a wake-up per poll (over a
#: thousand per step at 1 Gbit/s); a segment's wait is mostly predictable (about the previous
#: segment's), so the paced wait (the default) naps through most of it. The kernel's socket
#: buffers keep the link busy across a nap: Open MPI moves bytes only inside a poll.
_WAIT_MODE, _POLL_SLEEP_S = wait_settings()
_FIRST_SLEEP_S = 10e-6
#: The longest paced nap. Open MPI moves queued send bytes into the socket only inside a
#: poll, so a nap must end before the socket's send buffer drains: 1 ms is 125 KB at 1 Gbit/s.
#: (Naps of half the expected wait, 4 ms for a 1 MiB segment at 1 Gbit/s, measured 15% slower.)
_PACE_MAX_S = 1e-3


def wait_polled(req, expect_s: float = 0.0) -> float:
    """Complete ``req``; return how long it took (seconds).

    ``expect_s``: how long the wait is expected to take (paced mode: naps of half the rest
    of it, at most _PACE_MAX_S each, come first); then polls with sleeps that grow from 10 us to the longest sleep.
    """
    if _WAIT_MODE == "spin":
        req.Wait()
        return 0.0
    start = time.perf_counter()
    if req.Test():
        return 0.0
    if _WAIT_MODE == "paced" and expect_s > 0:
        left = expect_s
        while left > 4 * _FIRST_SLEEP_S:
            time.sleep(min(left / 2, _PACE_MAX_S))
            if req.Test():
                return time.perf_counter() - start
            left = expect_s - (time.perf_counter() - start)
    nap = min(_FIRST_SLEEP_S, _POLL_SLEEP_S)
    while not req.Test():
        time.sleep(nap)
        nap = min(2 * nap, _POLL_SLEEP_S)
    return time.perf_counter() - start


def _block_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive blocks of equal length; the trailing ones may be shorter or empty."""
    step = math.ceil(numel / parts)
    return [(min(i * step, numel), min((i + 1) * step, numel)) for i in range(parts)]


def _segments(lo: int, hi: int, seg: int):
    return [(a, min(a + seg, hi)) for a in range(lo, hi, seg)]


def ring_allreduce(
    mpi_comm,
    buf: torch.Tensor,
    seg_elems: int,
    scratch: torch.Tensor | None = None,
    watch: ProgressWatch | None = None,
) -> None:
    """Sum the contiguous CPU tensor ``buf`` over ``mpi_comm`` in place: segmented ring.

    Reduce-scatter then allgather around the ring (rank r sends to r+1), 2(n-1) steps, each
    moving one block of numel/n elements, cut into segments of ``seg_elems``. Every segment of
    a step is posted at once (Isend/Irecv), and segment k moves on to the next step as soon
    as it has arrived and been added, while later segments are still on the wire: reduction
    overlaps transfer and both directions of every link stay busy. Each block is summed once,
    by its owner, in ring order, and then copied to everyone: the result is bit-identical on
    every rank. ``scratch``: a uint8 CPU tensor of at least numel/n elements' bytes to hold
    incoming partial sums (allocated here if None). ``watch``: told of every segment that
    arrives from the left neighbour or leaves for the right one (the clock of that peer).
    """
    n, r = mpi_comm.Get_size(), mpi_comm.Get_rank()
    if n == 1 or buf.numel() == 0:
        return
    right, left = (r + 1) % n, (r - 1) % n
    arr = numpy_view(buf)
    blocks = _block_bounds(buf.numel(), n)
    block_len = blocks[0][1] - blocks[0][0]
    nbytes = block_len * buf.element_size()
    if scratch is None or scratch.numel() < nbytes:
        scratch = torch.empty(nbytes, dtype=torch.uint8)
    tmp = scratch[:nbytes].view(buf.dtype)  # incoming partial sums, one block
    tmp_arr = numpy_view(tmp)
    steps = 2 * (n - 1)

    def blocks_of(t: int) -> tuple[int, int]:
        # Reduce-scatter step t sends block r-t-1 (summed at step t-1) and receives block
        # r-t-2; after n-1 steps rank r owns the full sum of block r. Allgather step s sends
        # block r-s and receives block r-s-1.
        if t < n - 1:
            return (r - t - 1) % n, (r - t - 2) % n
        s = t - (n - 1)
        return (r - s) % n, (r - s - 1) % n

    plan = []  # per step: (send segments, recv segments, recv block's start)
    for t in range(steps):
        sb, rb = blocks_of(t)
        plan.append(
            (_segments(*blocks[sb], seg_elems), _segments(*blocks[rb], seg_elems), blocks[rb][0])
        )
    pending: list[dict[int, tuple]] = [dict() for _ in range(steps)]

    def post(t: int, k: int) -> None:
        sends, recvs, start = plan[t]
        rreq = None
        if k < len(recvs):
            lo, hi = recvs[k]
            if t < n - 1:  # partial sums land aside, then get added
                rreq = mpi_comm.Irecv(tmp_arr[lo - start : hi - start], left, _TAG_RING + t)
            else:  # finished sums land in place
                rreq = mpi_comm.Irecv(arr[lo:hi], left, _TAG_RING + t)
        sreq = None
        if k < len(sends):
            lo, hi = sends[k]
            sreq = mpi_comm.Isend(arr[lo:hi], right, _TAG_RING + t)
        pending[t][k] = (rreq, sreq)

    width = max(max(len(sends), len(recvs)) for sends, recvs, _ in plan)
    for k in range(width):
        post(0, k)
    expect = 0.0  # the previous segment's wait: segments of one ring arrive at a steady pace
    for t in range(steps):
        _, recvs, start = plan[t]
        for k in range(width):
            rreq, sreq = pending[t].pop(k)
            if rreq is not None:
                expect = wait_polled(rreq, expect)
                if watch is not None:
                    watch.heard(left)
                if t < n - 1:
                    lo, hi = recvs[k]
                    buf[lo:hi].add_(tmp[lo - start : hi - start])
            if sreq is not None:
                # The next step may receive into the memory this segment was sent from.
                wait_polled(sreq)
                if watch is not None:
                    watch.heard(right)
            if t + 1 < steps:
                post(t + 1, k)


def _exchange(
    mpi_comm,
    recv: np.ndarray,
    chunk: int,
    send_to,
    tag: int,
    seg_bytes: int,
    watch: ProgressWatch | None = None,
) -> None:
    """Receive every peer's ``chunk`` bytes into its slot of ``recv`` and send each peer
    ``send_to(peer)``, all as segmented Irecv/Isend posted at once, then wait. ``watch``
    hears of each peer's completed segments and lets go of a peer once it owes nothing."""
    n, r = mpi_comm.Get_size(), mpi_comm.Get_rank()
    reqs, peers = [], []
    for i in range(1, n):
        src = (r - i) % n
        for lo, hi in _segments(src * chunk, (src + 1) * chunk, seg_bytes):
            reqs.append(mpi_comm.Irecv(recv[lo:hi], src, tag))
            peers.append(src)
    receives = len(reqs)
    for i in range(1, n):
        dst = (r + i) % n
        data = send_to(dst)
        for lo, hi in _segments(0, data.size, seg_bytes):
            reqs.append(mpi_comm.Isend(data[lo:hi], dst, tag))
            peers.append(dst)
    owed = Counter(peers)
    expect = 0.0
    for i, req in enumerate(reqs):  # receives first, in the order they arrive, at a steady pace
        if i < receives:
            expect = wait_polled(req, expect)
        else:  # a send completes once its bytes are in the socket: no pacing
            wait_polled(req)
        if watch is not None:
            peer = peers[i]
            owed[peer] -= 1
            if owed[peer]:
                watch.heard(peer)
            else:
                watch.settle(peer)


def pairwise_alltoall(
    mpi_comm, send: np.ndarray, recv: np.ndarray, seg_bytes: int, watch: ProgressWatch | None = None
) -> None:
    """MPI_Alltoall of equal byte chunks as segmented Isend/Irecv to and from every peer."""
    r = mpi_comm.Get_rank()
    chunk = send.size // mpi_comm.Get_size()
    recv[r * chunk : (r + 1) * chunk] = send[r * chunk : (r + 1) * chunk]
    _exchange(
        mpi_comm,
        recv,
        chunk,
        lambda dst: send[dst * chunk : (dst + 1) * chunk],
        _TAG_ALLTOALL,
        seg_bytes,
        watch,
    )


def direct_allgather(
    mpi_comm, send: np.ndarray, recv: np.ndarray, seg_bytes: int, watch: ProgressWatch | None = None
) -> None:
    """MPI_Allgather as segmented Isend/Irecv of this rank's bytes to and from every peer."""
    r = mpi_comm.Get_rank()
    chunk = send.size
    recv[r * chunk : (r + 1) * chunk] = send
    _exchange(mpi_comm, recv, chunk, lambda dst: send, _TAG_ALLGATHER, seg_bytes, watch)
