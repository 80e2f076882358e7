"""Time of one all-reduce of one bucket on a machine: algorithm x links x codec.

The formulas of :mod:`commopt.sim.costs` with the machine's shared resources: a ring step
lasts as long as its slowest hop, where a hop's bytes are those of every flow sharing it
(the GPUs behind one PCIe uplink when transfers are staged through host memory; the GPUs of a
node behind its NIC).

Codec work: a linear codec (a cast) encodes the whole bucket, the transport sums in wire
format, and the result is decoded: encode + transfer + decode, one after the other. A
non-linear codec (QSGD) runs commopt's scatter-reduce/allgather, which cuts the bucket into
pieces of ``piece_bytes`` (``commopt.collectives.PIECE_BYTES``) and overlaps the codec work
of one piece with the transfers of its neighbours: see :func:`sra_pipelined`.

    >>> from commopt.sim.machines import get_machine
    >>> m = get_machine("testbed-1gbit")
    >>> t = allreduce_time(m, 2, numel=16 * 2**20, grad_bytes=4, algorithm="ring", codec="none")
    >>> round(t.total_s, 3)  # 64 MiB over 1 Gbit/s at 0.956 efficiency: 0.537 s / 0.956
    0.562
    >>> q = allreduce_time(m, 2, numel=16 * 2**20, grad_bytes=4, algorithm="scatter_reduce", codec="qsgd4")
    >>> round(q.total_s * 1e3, 1), round(q.hidden_s / q.codec_s, 2)  # ms; codec work hidden
    (77.4, 0.94)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from commopt.sim.codec_costs import CodecCost, get_codec_cost
from commopt.sim.costs import Link, pipeline_time
from commopt.sim.machines import Machine

#: fp32 bytes per piece of commopt's pipelined scatter-reduce/allgather; the same number as
#: ``commopt.collectives.PIECE_BYTES`` (a unit test checks that they agree).
SRA_PIECE_BYTES = 4 * 2**20


@dataclass(frozen=True)
class CommTime:
    transfer_s: float  # on the wire (latency + bandwidth)
    codec_s: float  # encode + decode
    wire_bytes: float  # bytes each GPU sends for this bucket
    hidden_s: float = 0.0  # codec work that runs while the link is busy (pipelined pieces)
    pieces: int = 1

    @property
    def total_s(self) -> float:
        return self.transfer_s + self.codec_s - self.hidden_s


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
            uplink = machine.uplink
            assert uplink is not None  # Machine.__post_init__ requires one for this layout
            lat = max(lat, uplink.latency_s)
            terms.append(active * flow_bytes / uplink.bandwidth_Bps)
        if machine.group_size and per_node > machine.group_size and machine.cross_group is not None:
            lat = max(lat, machine.cross_group.latency_s)
            if alltoall:
                # Every GPU of one group sends its share to each GPU of the other group.
                g = machine.group_size
                cross = g * (per_node - g) / max(n - 1, 1) * flow_bytes
            else:
                cross = flow_bytes  # a ring crosses between two groups once per direction
            terms.append(cross / machine.cross_group.bandwidth_Bps)
    if nodes > 1:
        lat = max(lat, machine.inter.latency_s)
        if alltoall:
            # The node's GPUs send the off-node part of their chunks through one NIC.
            nic = per_node * (n - per_node) / max(n - 1, 1) * flow_bytes
        else:
            nic = flow_bytes  # one ring edge leaves each node
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


def _sra_phase(
    machine: Machine, nodes: int, per_node: int, wire_bytes: float
) -> tuple[float, float]:
    """(fixed, bandwidth) seconds of one all-to-all phase over all GPUs moving (n-1)/n of
    ``wire_bytes`` per GPU: the n-1 messages go out back to back, so one latency and n-1 send
    overheads."""
    n = nodes * per_node
    lat, bw = _hop(machine, nodes, per_node, (n - 1) / n * wire_bytes, alltoall=True)
    return lat + (n - 1) * machine.message_overhead_s, bw


def sra_time(machine: Machine, nodes: int, per_node: int, wire_bytes: float) -> float:
    """Scatter-reduce then all-gather over all GPUs, one piece: two all-to-all phases of
    (n-1)/n S each (transfers only)."""
    if nodes * per_node == 1:
        return 0.0
    fixed, bw = _sra_phase(machine, nodes, per_node, wire_bytes)
    return 2 * (fixed + bw)


def hierarchical_time(
    machine: Machine, nodes: int, per_node: int, fp_bytes: float, wire_bytes: float, linear: bool
) -> float:
    """Reduce-scatter inside the node (uncompressed for a non-linear codec), all-reduce of
    each GPU's shard between nodes (ring for linear codecs, scatter-reduce/all-gather for the
    others; the node's shards share its NIC), all-gather inside the node. Transfers only,
    one piece."""
    if nodes == 1:
        if linear:
            return ring_time(machine, 1, per_node, wire_bytes)
        return sra_time(machine, 1, per_node, wire_bytes)
    intra_bytes = wire_bytes if linear else fp_bytes
    intra = 2 * _intra_half_ring(machine, per_node, intra_bytes)
    if linear:
        # per_node concurrent rings of S/g each: the NIC moves S/N per step.
        inter = machine.inter
        between = 2 * (nodes - 1) * (inter.latency_s + wire_bytes / (nodes * inter.bandwidth_Bps))
    else:
        fixed, bw = _inter_sra_phase(machine, nodes, wire_bytes)
        between = 2 * (fixed + bw)
    return intra + between


def _inter_sra_phase(machine: Machine, nodes: int, wire_bytes: float) -> tuple[float, float]:
    """One all-to-all phase between nodes of the node's g shards (S/g each, concurrently):
    the NIC carries (N-1)/N of the whole bucket's wire bytes."""
    inter = machine.inter
    return (
        inter.latency_s + (nodes - 1) * machine.message_overhead_s,
        (nodes - 1) / nodes * wire_bytes / inter.bandwidth_Bps,
    )


def on_transport(
    machine: Machine,
    nodes: int,
    per_node: int,
    wire_bytes: float,
    algorithm: str,
    codec_linear: bool = True,
) -> Machine:
    """The machine with its inter-node link as its transport delivers it to this collective.

    The message of a connection is one step's chunk, ``wire_bytes / n``; a ring or tree has one
    connection leaving each node, commopt's hierarchical ring one per GPU of the node, an
    all-to-all (scatter-reduce/all-gather) one per off-node peer of each GPU.
    """
    t = machine.transport
    if t is None or nodes == 1:
        return machine
    n = nodes * per_node
    if algorithm in ("scatter_reduce", "hierarchical") and not codec_linear:
        connections = (
            per_node * (n - per_node) if algorithm == "scatter_reduce" else per_node * (nodes - 1)
        )
    elif algorithm == "hierarchical":
        connections = per_node
    else:
        connections = 1
    bw = t.cap_Bps(machine.inter.bandwidth_Bps, wire_bytes / n, connections)
    if bw >= machine.inter.bandwidth_Bps:
        return machine
    return replace(machine, inter=Link(machine.inter.latency_s, bw))


def _with_machine_speeds(codec: CodecCost, machine: Machine) -> CodecCost:
    """The codec with the speeds measured on this machine, unless it carries its own."""
    speed = machine.codec_speed(codec.name)
    if speed is None or codec.encode_elems_per_s or codec.decode_elems_per_s:
        return codec
    return replace(
        codec, encode_elems_per_s=speed[0] * 1e9 / 4, decode_elems_per_s=speed[1] * 1e9 / 4
    )


def sra_codec_s(codec: CodecCost, machine: Machine, shard: float, k: int, grad_bytes: int) -> float:
    """Codec work of one scatter-reduce/allgather of ``shard`` elements among ``k`` workers,
    as commopt runs it: encode the k-1 peers' chunks, decode-and-add the k-1 received chunks,
    encode the own reduced chunk (the own term is never encoded before the sum), decode all k
    gathered chunks: encode S, decode (2k-1)/k S."""
    mem = machine.memory_GBps
    return codec.encode_s(shard, mem, grad_bytes) + codec.decode_s(
        (2 * k - 1) / k * shard, mem, grad_bytes
    )


def _pieces(numel: float, grad_bytes: int, piece_bytes: float) -> int:
    if not piece_bytes:
        return 1
    return max(1, math.ceil(numel * grad_bytes / piece_bytes))


def sra_pipelined(
    machine: Machine,
    nodes: int,
    per_node: int,
    numel: float,
    grad_bytes: int,
    codec: CodecCost,
    piece_bytes: float = SRA_PIECE_BYTES,
) -> CommTime:
    """commopt's scatter-reduce/allgather over all GPUs, pipelined over pieces.

    Per piece: encode the peers' chunks, alltoall, sum the own chunk, encode it, allgather,
    decode (``commopt.collectives``). The link and the processor work on neighbouring pieces
    at once, so the time is that of :func:`commopt.sim.costs.pipeline_time`: the slower of
    all transfers W and all codec work C, plus the faster one's share of one piece (fill
    and drain), plus two collective latencies per piece.
    """
    n = nodes * per_node
    wire = codec.wire_bytes(numel, grad_bytes)
    if n == 1:
        return CommTime(0.0, 0.0, 0.0)
    pieces = _pieces(numel, grad_bytes, piece_bytes)
    fixed, bw = _sra_phase(machine, nodes, per_node, wire / pieces)
    codec_s = (
        0.0 if codec.is_identity(grad_bytes) else sra_codec_s(codec, machine, numel, n, grad_bytes)
    )
    return _pipeline(2 * bw * pieces, 2 * fixed, codec_s, pieces, wire)


def _pipeline(
    wire_s: float,
    fixed_per_piece: float,
    codec_s: float,
    pieces: int,
    wire_bytes: float,
    before_s: float = 0.0,
) -> CommTime:
    transfer = wire_s + pieces * fixed_per_piece
    # What the pipeline hides: all but one piece of the faster resource's work, min(W, C)(1 - 1/p).
    hidden = (
        0.0
        if pieces == 1
        else transfer + codec_s - pipeline_time(wire_s, codec_s, pieces, fixed_per_piece)
    )
    return CommTime(
        transfer_s=before_s + transfer,
        codec_s=codec_s,
        wire_bytes=wire_bytes,
        hidden_s=hidden,
        pieces=pieces,
    )


def hierarchical_pipelined(
    machine: Machine,
    nodes: int,
    per_node: int,
    numel: float,
    grad_bytes: int,
    codec: CodecCost,
    piece_bytes: float = SRA_PIECE_BYTES,
) -> CommTime:
    """Hierarchical all-reduce with a non-linear codec: uncompressed reduce-scatter and
    all-gather inside the node, and between nodes each GPU's pipelined scatter-reduce/
    allgather of its shard (S/g elements, pieces of ``piece_bytes``), the node's shards
    sharing its NIC."""
    if nodes == 1:
        return sra_pipelined(machine, 1, per_node, numel, grad_bytes, codec, piece_bytes)
    wire = codec.wire_bytes(numel, grad_bytes)
    intra = 2 * _intra_half_ring(machine, per_node, numel * grad_bytes)
    shard = numel / per_node
    pieces = _pieces(shard, grad_bytes, piece_bytes)
    fixed, bw = _inter_sra_phase(machine, nodes, wire / pieces)
    codec_s = (
        0.0
        if codec.is_identity(grad_bytes)
        else sra_codec_s(codec, machine, shard, nodes, grad_bytes)
    )
    return _pipeline(2 * bw * pieces, 2 * fixed, codec_s, pieces, wire, before_s=intra)


def _cast_codec_s(codec: CodecCost, machine: Machine, numel: float, grad_bytes: int) -> float:
    """A linear codec casts once, the transport sums in wire format, the result is cast back."""
    if codec.is_identity(grad_bytes):
        return 0.0
    mem = machine.memory_GBps
    return codec.encode_s(numel, mem, grad_bytes) + codec.decode_s(numel, mem, grad_bytes)


def allreduce_time(
    machine: Machine,
    gpus: int,
    *,
    numel: float,
    grad_bytes: int,
    algorithm: str,
    codec: str | CodecCost = "none",
    piece_bytes: float = SRA_PIECE_BYTES,
) -> CommTime:
    """Seconds to all-reduce ``numel`` gradient elements of ``grad_bytes`` each over ``gpus``.

    ``piece_bytes``: gradient bytes per piece of the pipelined scatter-reduce/allgather
    (non-linear codecs; 0: one piece, no overlap of codec work and transfers).
    """
    codec = _with_machine_speeds(get_codec_cost(codec), machine)
    nodes, per_node = machine.layout(gpus)
    if piece_bytes < 0:
        raise ValueError(f"piece size must be >= 0 bytes (0: no pipeline), got {piece_bytes}")
    if algorithm == "auto":
        algorithm = "hierarchical" if nodes > 1 else ("ring" if codec.linear else "scatter_reduce")
    if algorithm in ("ring", "tree") and not codec.linear:
        raise ValueError(
            f"codec {codec.name} is not linear; use scatter_reduce or hierarchical with it"
        )
    if gpus == 1:
        return CommTime(0.0, 0.0, 0.0)
    if algorithm not in ("ring", "tree", "scatter_reduce", "hierarchical"):
        raise ValueError(f"unknown algorithm {algorithm!r}")
    machine = on_transport(
        machine, nodes, per_node, codec.wire_bytes(numel, grad_bytes), algorithm, codec.linear
    )
    if algorithm == "scatter_reduce":
        return sra_pipelined(machine, nodes, per_node, numel, grad_bytes, codec, piece_bytes)
    if algorithm == "hierarchical" and not codec.linear:
        return hierarchical_pipelined(
            machine, nodes, per_node, numel, grad_bytes, codec, piece_bytes
        )
    wire = codec.wire_bytes(numel, grad_bytes)
    if algorithm == "ring":
        transfer = ring_time(machine, nodes, per_node, wire)
    elif algorithm == "tree":
        transfer = tree_time(machine, nodes, per_node, wire)
    else:
        transfer = hierarchical_time(
            machine, nodes, per_node, numel * grad_bytes, wire, linear=True
        )
    return CommTime(
        transfer_s=transfer,
        codec_s=_cast_codec_s(codec, machine, numel, grad_bytes),
        wire_bytes=wire,
    )
