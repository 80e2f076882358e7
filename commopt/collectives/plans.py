"""The allreduce algorithms as plans: native, scatter-reduce (pipelined), hierarchical.

A plan is built on the caller's thread (the native plan of a host-ordered transport encodes
there) and returns the callable that runs the reduction, on the communicator's worker (:mod:`commopt.driver`) or,
for a world of one, at once. ``PLANS`` maps each algorithm name to its builder; the
choice among them is :mod:`commopt.collectives.choice`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from commopt.codecs.base import Codec, RngKey
from commopt.codecs.cast import CastCodec
from commopt.collectives.choice import choose_algorithm
from commopt.collectives.layout import (
    PHASE_GATHER,
    PHASE_SCATTER,
    PIECE_BYTES,
    chunk_bounds,
    chunk_rng,
    elements_per_piece,
    scatter_reduce_layout,
    sub_key,
)
from commopt.comm.base import Communicator, Work
from commopt.comm.topology import hierarchy
from commopt.profiling import phase

__all__ = ["PLANS", "plan_hierarchical", "plan_native", "plan_scatter_reduce"]


# The phases of a plan, as torch.profiler ranges (commopt.profiling).
def _encode(codec: Codec, src: torch.Tensor, out: torch.Tensor, **kwargs: Any) -> None:
    with phase("encode"):
        codec.encode(src, out, **kwargs)


def _decode(codec: Codec, wire: torch.Tensor, out: torch.Tensor, **kwargs: Any) -> None:
    with phase("decode"):
        codec.decode(wire, out, **kwargs)


def _decode_scaled(codec: Codec, wire: torch.Tensor, out: torch.Tensor, **kwargs: Any) -> None:
    with phase("decode"):
        codec.decode_scaled(wire, out, **kwargs)


def _transport(call: Callable[..., Work | None], *args: Any, **kwargs: Any) -> Work | None:
    with phase("transport"):
        return call(*args, **kwargs)


def _wait(work: Work) -> None:
    with phase("wait"):
        work.wait()


def _started(work: Work | None) -> Work:
    """The Work of a collective issued with ``async_op=True`` (which always returns one)."""
    if work is None:
        raise RuntimeError(
            "a communicator returned no Work for async_op=True: it breaks the "
            "Communicator contract (commopt/comm/base.py)"
        )
    return work


# Each plan returns a callable that runs the reduction (on the driver thread, or at once);
# the native plan encodes on the caller's thread first, the others do all their work later.
def plan_native(
    comm: Communicator,
    flat: torch.Tensor,
    codec: Codec,
    factor: float,
    rng: RngKey | None,
    key: str | None,
    piece_bytes: int | None = None,
) -> Callable[[], None]:
    wire_dtype = codec.wire_dtype
    if wire_dtype is None:  # check_arguments lets only linear codecs (with a wire dtype) here
        raise ValueError(f"the native algorithm needs a linear codec, not {codec.name!r}")
    if wire_dtype == flat.dtype:
        # A cast to the buffer's own dtype is the identity: reduce the buffer in place.
        if factor != 1.0:
            flat.mul_(factor)

        def in_place() -> None:
            _transport(comm.allreduce, flat)

        return in_place
    piece = PIECE_BYTES if piece_bytes is None else int(piece_bytes)
    if isinstance(codec, CastCodec) and 0 < piece < flat.numel() * flat.element_size():
        return _plan_cast_pieces(comm, flat, codec, factor, piece // flat.element_size())
    nbytes = codec.encoded_nbytes(flat.numel())
    if comm.stream_ordered:
        # Encode on the communicator's stream too: the wire buffer is then allocated, used
        # and freed in one stream's order, and the caching allocator cannot hand its block
        # to the caller's stream while the transfer or the decode still reads it.
        def on_stream() -> None:
            wire = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
            _encode(codec, flat, wire, scale=factor, rng=rng, key=key)
            _transport(comm.allreduce, wire.view(wire_dtype))
            _decode(codec, wire, flat, accumulate=False)

        return on_stream
    wire = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    _encode(codec, flat, wire, scale=factor, rng=rng, key=key)

    def finish() -> None:
        _transport(comm.allreduce, wire.view(wire_dtype))
        _decode(codec, wire, flat, accumulate=False)

    return finish


def _plan_cast_pieces(
    comm: Communicator,
    flat: torch.Tensor,
    codec: CastCodec,
    factor: float,
    piece_elems: int,
) -> Callable[[], None]:
    """The native plan of a cast codec (fp16, bf16) as a pipeline of pieces.

    Casting the whole buffer before the transfer and back after it puts two passes over
    the buffer (tens of ms at 64 MiB on a busy host) in series with the wire. Cut into
    pieces, every piece is cast and handed to the transport at once (the transport runs
    them in order, back to back), and piece k is cast back while later pieces are on the
    wire: only the first piece's cast and the last one's cast back stay exposed. Cast
    codecs keep no state and draw no random numbers, so the result is the same bits.
    """
    bounds = [
        (lo, min(lo + piece_elems, flat.numel()))
        for lo in range(0, flat.numel(), max(1, piece_elems))
    ]

    def finish() -> None:
        wire = torch.empty(
            codec.encoded_nbytes(flat.numel()), dtype=torch.uint8, device=flat.device
        )
        typed = wire.view(codec.wire_dtype)  # type: ignore[arg-type]  # a cast codec has one
        works = []
        for lo, hi in bounds:
            _encode(codec, flat[lo:hi], typed[lo:hi].view(torch.uint8), scale=factor)
            works.append(_started(_transport(comm.allreduce, typed[lo:hi], async_op=True)))
        for (lo, hi), work in zip(bounds, works):
            _wait(work)
            _decode(codec, typed[lo:hi].view(torch.uint8), flat[lo:hi], accumulate=False)

    return finish


def plan_scatter_reduce(
    comm: Communicator,
    flat: torch.Tensor,
    codec: Codec,
    factor: float,
    rng: RngKey | None,
    key: str | None,
    piece_bytes: int | None = None,
) -> Callable[[], None]:
    """Scatter-reduce then allgather, pipelined over pieces of ``piece_bytes`` fp32 bytes.

    Per piece: encode the peers' chunks, alltoall, sum the own chunk in fp32, encode it,
    allgather, decode. The transfers of one piece run while the codec works on the
    neighbouring pieces, so a large buffer costs about its wire time plus the codec work of
    one piece, not wire time plus codec work of the whole buffer. The own chunk never
    travels, so it is never encoded: it enters the sum exactly.
    """
    size, rank = comm.size, comm.rank
    # (commopt.collectives.residuals places error-feedback residuals by the same layout)
    layout = scatter_reduce_layout(
        flat.numel(), size, codec.alignment, elements_per_piece(piece_bytes, flat.element_size())
    )
    first_lo, first_hi = layout[0][0]
    slot = codec.encoded_nbytes(first_hi - first_lo)
    span = size * slot  # bytes of one piece on the wire (each rank's slot, padded)
    pieces = len(layout)
    undo = 1.0 / factor if factor != 0.0 else 0.0  # peers' terms back to the own term's scale

    def nbytes(lo: int, hi: int) -> int:
        return codec.encoded_nbytes(hi - lo)

    def finish() -> None:
        send = torch.empty(pieces * span, dtype=torch.uint8, device=flat.device)
        recv = torch.empty_like(send)

        def region(buf: torch.Tensor, k: int) -> torch.Tensor:
            return buf[k * span : (k + 1) * span]

        def encode_peers_chunks(k: int) -> None:
            for j, (lo, hi) in enumerate(layout[k]):
                if j != rank and hi > lo:
                    off = k * span + j * slot
                    _encode(
                        codec,
                        flat[lo:hi],
                        send[off : off + nbytes(lo, hi)],
                        scale=factor,
                        rng=chunk_rng(rng, PHASE_SCATTER, k * size + j),
                        key=sub_key(key, f"rs{k * size + j}"),
                    )

        def start_scatter(k: int) -> Work:
            return _started(
                _transport(comm.alltoall, region(send, k), region(recv, k), async_op=True)
            )

        def reduce_own_chunk(k: int) -> None:
            lo, hi = layout[k][rank]
            if hi == lo:
                return
            mine = flat[lo:hi]
            # Sum own term first, then the peers in rank order, without scaling the own
            # term in a pass of its own: sum x_own + n * peer_i (the peers were sent
            # already multiplied by factor = scale / n) and let the encode multiply by
            # factor. With n a power of two this is bit for bit factor * x_own + sum peer_i.
            for i in range(size):
                if i != rank:
                    off = k * span + i * slot
                    _decode_scaled(
                        codec, recv[off : off + nbytes(lo, hi)], mine, accumulate=True, alpha=undo
                    )
            # recv's own slot never carried data: it becomes the allgather input.
            off = k * span + rank * slot
            _encode(
                codec,
                mine,
                recv[off : off + nbytes(lo, hi)],
                scale=factor,
                rng=chunk_rng(rng, PHASE_GATHER, k),
                key=sub_key(key, f"ag{k}"),
            )

        def start_gather(k: int) -> Work:
            # send's piece is free once its alltoall is done: it receives the reduced chunks.
            off = k * span + rank * slot
            return _started(
                _transport(comm.allgather, recv[off : off + slot], region(send, k), async_op=True)
            )

        def decode_piece(k: int) -> None:
            # Every rank, the owner included, decodes the same bytes: identical results.
            for j, (lo, hi) in enumerate(layout[k]):
                if hi > lo:
                    off = k * span + j * slot
                    _decode(codec, send[off : off + nbytes(lo, hi)], flat[lo:hi], accumulate=False)

        # Two scatters in flight keep the link busy while piece k is summed and encoded.
        # Every rank issues the transport's collectives in the same order:
        # scatter 0, scatter 1, gather 0, scatter 2, gather 1, ...
        scatters: dict[int, Work] = {}  # piece -> its alltoall, once started
        gathers: dict[int, Work] = {}
        for k in range(min(2, pieces)):
            encode_peers_chunks(k)
            scatters[k] = start_scatter(k)
        for k in range(pieces):
            _wait(scatters[k])
            reduce_own_chunk(k)
            gathers[k] = start_gather(k)
            if k + 2 < pieces:
                encode_peers_chunks(k + 2)
                scatters[k + 2] = start_scatter(k + 2)
            if k >= 1:
                _wait(gathers[k - 1])
                decode_piece(k - 1)
        _wait(gathers[pieces - 1])
        decode_piece(pieces - 1)

    return finish


def plan_hierarchical(
    comm: Communicator,
    flat: torch.Tensor,
    codec: Codec,
    factor: float,
    rng: RngKey | None,
    key: str | None,
    piece_bytes: int | None = None,
) -> Callable[[], None]:
    def finish() -> None:
        intra, inter = hierarchy(comm)
        n = flat.numel()
        bounds = chunk_bounds(n, intra.size, codec.alignment)
        shard_len = bounds[0][1] - bounds[0][0]
        padded_len = shard_len * intra.size
        if padded_len == n:
            padded = flat
        else:
            padded = torch.zeros(padded_len, dtype=flat.dtype, device=flat.device)
            padded[:n].copy_(flat)
        # 1. reduce-scatter inside the node, uncompressed (fp32, fast links).
        recv = torch.empty_like(padded)
        _transport(intra.alltoall, padded, recv)
        pieces = recv.view(intra.size, shard_len)
        shard = pieces[0].clone()
        for i in range(1, intra.size):
            shard.add_(pieces[i])
        # 2. the compressed algorithm across nodes, on this rank's shard.
        if inter.size > 1:
            inner = choose_algorithm(inter, codec)
            PLANS[inner](inter, shard, codec, factor, rng, sub_key(key, "x"), piece_bytes)()
        elif factor != 1.0:
            shard.mul_(factor)
        # 3. allgather inside the node.
        _transport(intra.allgather, shard, padded)
        if padded is not flat:
            flat.copy_(padded[:n])

    return finish


PLANS = {
    "native": plan_native,
    "scatter_reduce": plan_scatter_reduce,
    "hierarchical": plan_hierarchical,
}
