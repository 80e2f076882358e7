"""Alpha-beta costs of the collectives, as pure functions of sizes and links.

A :class:`Link` is a latency (alpha, seconds) and an effective bandwidth (beta, bytes per
second, one direction). The textbook formulas are here unchanged so that they can be tested
as written; :mod:`commopt.sim.topology` applies them to a machine with shared links.

    >>> ring = ring_allreduce_time(4, 64 * 2**20, Link(latency_s=0.0, bandwidth_Bps=1e9))
    >>> round(ring, 4)  # 2(n-1)/n * S / beta = 1.5 * 64 MiB / 1 GB/s
    0.1007
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
GBYTE = 1e9  # bytes per second in one GB/s


@dataclass(frozen=True)
class Link:
    """One hop: ``latency_s`` per message plus ``nbytes / bandwidth_Bps``.

    ``bandwidth_Bps`` is what a transfer achieves in one direction (line rate times protocol
    efficiency); machine presets document both factors.
    """

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self):
        if not self.latency_s >= 0:
            raise ValueError(f"link latency must be >= 0 seconds, got {self.latency_s}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth_Bps}")

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps

    def scaled(self, bandwidth_factor: float) -> Link:
        return Link(self.latency_s, self.bandwidth_Bps * bandwidth_factor)


def _check(n: int, nbytes: float) -> None:
    if int(n) != n or n < 1:
        raise ValueError(f"number of workers must be a positive integer, got {n}")
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {nbytes}")


def ring_allreduce_time(n: int, nbytes: float, link: Link) -> float:
    """Ring all-reduce: reduce-scatter then all-gather, 2(n-1) steps of S/n each.

    T = 2(n-1) * (alpha + S / (n * beta)); 0 for one worker.
    """
    _check(n, nbytes)
    if n == 1:
        return 0.0
    return 2 * (n - 1) * link.time(nbytes / n)


def ring_reduce_scatter_time(n: int, nbytes: float, link: Link) -> float:
    """(n-1) steps of S/n: half of a ring all-reduce."""
    _check(n, nbytes)
    return (n - 1) * link.time(nbytes / n) if n > 1 else 0.0


ring_allgather_time = ring_reduce_scatter_time


def tree_allreduce_time(n: int, nbytes: float, link: Link) -> float:
    """Pipelined (double binary) tree: reduce up and broadcast down.

    Latency grows with the depth, 2 * ceil(log2 n) * alpha; the bandwidth term is 2 S / beta
    (each of the two trees carries half of the data, every node sends and receives about S in
    each phase), which is what the ring reaches for large n.
    """
    _check(n, nbytes)
    if n == 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency_s + 2 * nbytes / link.bandwidth_Bps


def alltoall_phase_time(n: int, nbytes: float, link: Link, message_overhead_s: float) -> float:
    """One scatter-reduce (or all-gather) phase over a non-blocking switch.

    Every worker sends one chunk of S/n to each of the n-1 others, back to back: their network
    latencies overlap, each costs the sender ``message_overhead_s`` (LogP's o):
    alpha + (n-1) o + (n-1)/n S/beta.
    """
    _check(n, nbytes)
    if n == 1:
        return 0.0
    return link.latency_s + (n - 1) * message_overhead_s + (n - 1) / n * nbytes / link.bandwidth_Bps


def scatter_reduce_allgather_time(
    n: int, nbytes: float, link: Link, message_overhead_s: float
) -> float:
    """Scatter-reduce then all-gather of compressed chunks: the same bytes as the ring, in two
    phases of n-1 concurrent messages instead of 2(n-1) sequential steps."""
    return 2 * alltoall_phase_time(n, nbytes, link, message_overhead_s)


def hierarchical_allreduce_time(
    gpus_per_node: int, nodes: int, nbytes: float, intra: Link, inter: Link
) -> float:
    """Intra-node reduce-scatter, inter-node ring all-reduce of each GPU's 1/g shard (the g
    shards of a node share its NIC, so the NIC carries S/N per ring step), intra all-gather.

    T = 2 (g-1) (alpha_i + S/(g beta_i)) + 2 (N-1) (alpha_e + S/(N beta_e))
    """
    _check(gpus_per_node, nbytes)
    _check(nodes, nbytes)
    intra_part = 2 * ring_reduce_scatter_time(gpus_per_node, nbytes, intra)
    inter_part = 0.0
    if nodes > 1:
        inter_part = 2 * (nodes - 1) * (inter.latency_s + nbytes / (nodes * inter.bandwidth_Bps))
    return intra_part + inter_part


def pipeline_time(
    wire_s: float, codec_s: float, pieces: int, fixed_s_per_piece: float = 0.0
) -> float:
    """A buffer cut into ``pieces`` equal pieces, each of which needs the link (``wire_s / pieces``
    of transfers) and the processor (``codec_s / pieces`` of codec work), one piece's codec work
    overlapping the neighbouring pieces' transfers:

    T = max(W, C) + min(W, C) / p + p * fixed

    The slower resource sets the pace; the faster one's share of one piece is not hidden (the
    first piece's encode before the link has anything to send, the last piece's decode after
    it is done: fill and drain). ``fixed_s_per_piece`` is what every piece's collectives cost
    regardless of size (their latencies). One piece is the unpipelined sum W + C + fixed.

        >>> round(pipeline_time(0.075, 0.019, pieces=16) * 1e3, 4)  # wire-bound: 75 + 19/16 ms
        76.1875
    """
    if int(pieces) != pieces or pieces < 1:
        raise ValueError(f"number of pieces must be a positive integer, got {pieces}")
    if wire_s < 0 or codec_s < 0 or fixed_s_per_piece < 0:
        raise ValueError(
            f"pipeline times must be >= 0 s, got wire {wire_s}, codec {codec_s}, "
            f"fixed {fixed_s_per_piece}"
        )
    return max(wire_s, codec_s) + min(wire_s, codec_s) / pieces + pieces * fixed_s_per_piece
