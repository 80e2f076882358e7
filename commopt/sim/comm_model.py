"""Time of one all-reduce of one bucket on a machine: algorithm x links x codec.

The formulas of :mod:`commopt.sim.costs` with the machine's shared resources: a ring step
lasts as long as its slowest hop, where a hop's bytes are those of every flow sharing it
(the GPUs behind one PCIe uplink when transfers are staged through host memory; the GPUs of a
node behind its NIC). Codec work (encode, decode) runs in the communication stream, before,
between and after the transfers of the same bucket.

    >>> from commopt.sim.machines import get_machine
    >>> m = get_machine("testbed-1gbit")
    >>> t = allreduce_time(m, 2, numel=16 * 2**20, grad_bytes=4, algorithm="ring", codec="none")
    >>> round(t.total_s, 3)      # 64 MiB over 1 Gbit/s at 0.956 efficiency: 0.537 s / 0.956
    0.562
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from commopt.sim.codec_costs import CodecCost, get_codec
from commopt.sim.machines import Machine


@dataclass(frozen=True)
class CommTime:
    transfer_s: float      # on the wire (latency + bandwidth)
    codec_s: float         # encode + decode
    wire_bytes: float      # bytes each GPU sends for this bucket

    @property
    def total_s(self) -> float:
        return self.transfer_s + self.codec_s


def _hop(machine: Machine, nodes: int, per_node: int, flow_bytes: float, alltoall: bool = False):
    """(latency, seconds for bytes) of one synchronous step in which every GPU sends
    ``flow_bytes`` to its successor (ring) or, with ``alltoall``, to the others in total."""
    n = nodes * per_node
    lat, terms = 0.0, [0.0]
    if per_node > 1:
        lat = max(lat, machine.intra.latency_s)
        terms.append(flow_bytes / machine.intra.bandwidth_Bps)
        if not machine.p2p and machine.group_size:
            # Staged through host memory: every active GPU of a group crosses the uplink.
            active = min(per_node, machine.group_size)
            lat = max(lat, machine.uplink.latency_s)
            terms.append(active * flow_bytes / machine.uplink.bandwidth_Bps)
        if machine.group_size and per_node > machine.group_size and machine.cross_group is not None:
            lat = max(lat, machine.cross_group.latency_s)
            if alltoall:
                # Every GPU of one group sends its share to each GPU of the other group.
                g = machine.group_size
                cross = g * (per_node - g) / max(n - 1, 1) * flow_bytes
            else:
                cross = flow_bytes   # a ring crosses between two groups once per direction
            terms.append(cross / machine.cross_group.bandwidth_Bps)
    if nodes > 1:
        lat = max(lat, machine.inter.latency_s)
        if alltoall:
            # The node's GPUs send the off-node part of their chunks through one NIC.
            nic = per_node * (n - per_node) / max(n - 1, 1) * flow_bytes
        else:
            nic = flow_bytes    # one ring edge leaves each node
        terms.append(nic / machine.inter.bandwidth_Bps)
    return lat, max(terms)


def ring_time(machine: Machine, nodes: int, per_node: int, nbytes: float) -> float:
    n = nodes * per_node
    if n == 1:
        return 0.0
    lat, bw = _hop(machine, nodes, per_node, nbytes / n)
    return 2 * (n - 1) * (lat + bw)


def _intra_half_ring(machine: Machine, per_node: int, nbytes: float) -> float:
    """Reduce-scatter (or all-gather) inside one node: (g-1) steps of S/g."""
    if per_node == 1:
        return 0.0
    lat, bw = _hop(machine, 1, per_node, nbytes / per_node)
    return (per_node - 1) * (lat + bw)


def tree_time(machine: Machine, nodes: int, per_node: int, nbytes: float) -> float:
    """Chain inside nodes, double binary tree between them, pipelined: latencies add up,
    the slower of the two bandwidth terms counts."""
    intra_lat, intra_bw = (0.0, 0.0)
    if per_node > 1:
        intra_lat, intra_bw = _hop(machine, 1, per_node, nbytes)
    lat = 2 * (per_node - 1) * intra_lat
    inter_bw = 0.0
    if nodes > 1:
        lat += 2 * math.ceil(math.log2(nodes)) * machine.inter.latency_s
        inter_bw = nbytes / machine.inter.bandwidth_Bps
    return lat + 2 * max(intra_bw, inter_bw)


def sra_time(machine: Machine, nodes: int, per_node: int, wire_bytes: float) -> float:
    """Scatter-reduce then all-gather over all GPUs: two all-to-all phases of (n-1)/n S each."""
    n = nodes * per_node
    if n == 1:
        return 0.0
    lat, bw = _hop(machine, nodes, per_node, (n - 1) / n * wire_bytes, alltoall=True)
    # The n-1 messages go out back to back: one latency, n-1 send overheads.
    return 2 * (lat + (n - 1) * machine.message_overhead_s + bw)


def hierarchical_time(machine: Machine, nodes: int, per_node: int, fp_bytes: float,
                      wire_bytes: float, linear: bool) -> float:
    """Reduce-scatter inside the node (uncompressed for a non-linear codec), all-reduce of
    each GPU's shard between nodes (ring for linear codecs, scatter-reduce/all-gather for the
    others; the node's shards share its NIC), all-gather inside the node."""
    if nodes == 1:
        if linear:
            return ring_time(machine, 1, per_node, wire_bytes)
        return sra_time(machine, 1, per_node, wire_bytes)
    intra_bytes = wire_bytes if linear else fp_bytes
    intra = 2 * _intra_half_ring(machine, per_node, intra_bytes)
    inter = machine.inter
    if linear:
        # per_node concurrent rings of S/g each: the NIC moves S/N per step.
        between = 2 * (nodes - 1) * (inter.latency_s + wire_bytes / (nodes * inter.bandwidth_Bps))
    else:
        between = 2 * (inter.latency_s + (nodes - 1) * machine.message_overhead_s
                       + (nodes - 1) / nodes * wire_bytes / inter.bandwidth_Bps)
    return intra + between


def _codec_time(codec: CodecCost, machine: Machine, algorithm: str, nodes: int, per_node: int,
                numel: float, grad_bytes: int) -> float:
    mem = machine.memory_GBps

    def enc(x):
        return codec.encode_s(x, mem, grad_bytes)

    def dec(x):
        return codec.decode_s(x, mem, grad_bytes)

    n = nodes * per_node
    if codec.is_identity(grad_bytes) or n == 1:
        return 0.0
    if codec.linear:
        return enc(numel) + dec(numel)        # cast once, sum in wire format, cast back
    if algorithm == "hierarchical" and nodes > 1:
        shard, k = numel / per_node, nodes
    else:
        shard, k = numel, n
    # encode all, decode the k-1 received chunks, re-encode the reduced chunk, decode the
    # k-1 gathered chunks.
    return enc(shard) + dec((k - 1) / k * shard) + enc(shard / k) + dec((k - 1) / k * shard)


def allreduce_time(machine: Machine, gpus: int, *, numel: float, grad_bytes: int, algorithm: str,
                   codec: str | CodecCost = "none") -> CommTime:
    """Seconds to all-reduce ``numel`` gradient elements of ``grad_bytes`` each over ``gpus``."""
    codec = get_codec(codec)
    nodes, per_node = machine.layout(gpus)
    if algorithm == "auto":
        algorithm = "hierarchical" if nodes > 1 else ("ring" if codec.linear else "sra")
    fp_bytes = numel * grad_bytes
    wire = codec.wire_bytes(numel, grad_bytes)
    if algorithm in ("ring", "tree") and not codec.linear:
        raise ValueError(f"codec {codec.name} is not linear; use sra or hierarchical with it")
    if algorithm == "ring":
        transfer = ring_time(machine, nodes, per_node, wire)
    elif algorithm == "tree":
        transfer = tree_time(machine, nodes, per_node, wire)
    elif algorithm == "sra":
        transfer = sra_time(machine, nodes, per_node, wire)
    elif algorithm == "hierarchical":
        transfer = hierarchical_time(machine, nodes, per_node, fp_bytes, wire, codec.linear)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    codec_s = _codec_time(codec, machine, algorithm, nodes, per_node, numel, grad_bytes)
    return CommTime(transfer_s=transfer, codec_s=codec_s, wire_bytes=wire if gpus > 1 else 0.0)
