"""Allreduce algorithms over a Communicator, for flat fp32 buffers and any Codec.

``allreduce(comm, flat, codec)`` leaves in ``flat`` the mean (or the sum) over all ranks,
as every rank sees it bit for bit the same:

    >>> import torch, commopt
    >>> from commopt import collectives
    >>> comm = commopt.create_communicator("local")
    >>> x = torch.tensor([1.0, 2.0, 3.0])
    >>> collectives.allreduce(comm, x, None, algorithm="scatter_reduce").wait()
    >>> x.tolist()
    [1.0, 2.0, 3.0]

Algorithms (``algorithm=``):

``native``
    the transport sums the encoded buffer itself. Only for linear codecs whose wire dtype
    the transport sums (``comm.supports_sum(codec.wire_dtype)``), or no codec at all.
``scatter_reduce``
    encode each peer's chunk, alltoall, decode-and-add in fp32 (the own chunk, which does
    not travel, enters exactly), re-encode the reduced chunk, allgather, decode. Works for
    every codec (the published QSGD/CGX scheme). Large buffers run as a pipeline of
    pieces (``piece_bytes``) so that codec work overlaps the transfers. Chunk boundaries
    fall on multiples of ``codec.alignment`` so chunking never changes how a quantization
    bucket is encoded.
``hierarchical``
    with several ranks per node: reduce-scatter inside the node in fp32 (uncompressed),
    the compressed algorithm across nodes on each shard, allgather inside the node.
    The intra/inter communicators are built once per communicator (:mod:`commopt.topology`).
``auto`` (default)
    identity for a world of one, hierarchical when there are several nodes with the same
    number (> 1) of ranks each, else native when possible, else scatter_reduce.

Averaging (``average=True``) divides by the world size *before* encoding, so a 16-bit sum
cannot overflow where the mean would not.

Asynchrony: ``async_op=True`` returns a :class:`~commopt.comm.base.Work` at once; the
reduction runs on the communicator's worker (:mod:`commopt.driver`), in issue order, so every rank issues
the transport's collectives in the same order. ``flat`` belongs to the reduction until
the Work completes (native cast codecs encode on the calling thread). Do not call the
communicator's own collectives while an asynchronous allreduce is in flight: wait first.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from commopt.codecs.base import Codec, RngKey
from commopt import driver
from commopt.comm.base import CompletedWork, Communicator, Work
from commopt.topology import hierarchy, uniform_nodes

__all__ = [
    "ALGORITHMS", "PIECE_BYTES", "allreduce", "choose_algorithm", "chunk_bounds", "scatter_reduce_layout",
]

ALGORITHMS = ("auto", "native", "scatter_reduce", "hierarchical", "identity")

# RNG stream layout: the caller's stream, then the phase, then the chunk index.
_PHASE_SCATTER = 0
_PHASE_GATHER = 1
_CHUNK_BITS = 24

#: fp32 bytes per piece of the scatter-reduce pipeline: large enough that a transfer's
#: fixed cost is small against its wire time, small enough that the codec work of the
#: first and last piece (not hidden behind transfers) is a few milliseconds.
PIECE_BYTES = 4 << 20

_DONE = CompletedWork()


# -- a codec for "no codec": the buffer's own dtype, exact ------------------------------------
class _Exact(Codec):
    """Identity codec over any dtype (used when ``codec`` is None)."""

    name = "exact"
    linear = True

    def __init__(self, dtype: torch.dtype):
        self.wire_dtype = dtype
        self._itemsize = torch.empty((), dtype=dtype).element_size()

    def encoded_nbytes(self, numel: int) -> int:
        return numel * self._itemsize

    def encode(self, x, out, *, scale=1.0, rng=None, key=None) -> None:
        dst = out.view(self.wire_dtype)[: x.numel()]
        if scale == 1.0:
            dst.copy_(x)
        else:
            torch.mul(x, scale, out=dst)

    def decode(self, wire, out, *, accumulate=False) -> None:
        src = wire.view(self.wire_dtype)[: out.numel()]
        if accumulate:
            out.add_(src)
        else:
            out.copy_(src)


# -- geometry -------------------------------------------------------------------------------
def chunk_bounds(numel: int, parts: int, alignment: int = 1) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` chunks starting at multiples of ``alignment``.

    All chunks but the trailing ones have the same length; trailing chunks may be shorter
    or empty.

        >>> chunk_bounds(10, 3, 4)
        [(0, 4), (4, 8), (8, 10)]
        >>> chunk_bounds(5, 4, 4)
        [(0, 4), (4, 5), (5, 5), (5, 5)]
    """
    alignment = max(1, int(alignment))
    units = math.ceil(numel / alignment)
    step = math.ceil(units / parts) * alignment if units else 0
    return [(min(i * step, numel), min((i + 1) * step, numel)) for i in range(parts)]


def _chunk_rng(rng: RngKey | None, phase: int, index: int) -> RngKey | None:
    if rng is None:
        return None
    if index >> _CHUNK_BITS:
        raise ValueError(f"too many chunks for one allreduce ({index}); raise piece_bytes")
    stream = (rng.stream << (_CHUNK_BITS + 1)) | (phase << _CHUNK_BITS) | index
    return RngKey(rng.seed, rng.rank, rng.step, stream)


def _sub_key(key, suffix: str):
    return None if key is None else f"{key}/{suffix}"


# -- algorithm choice ---------------------------------------------------------------------------
def _native_ok(comm: Communicator, codec: Codec) -> bool:
    return bool(codec.linear) and codec.wire_dtype is not None and comm.supports_sum(codec.wire_dtype)


def choose_algorithm(comm: Communicator, codec: Codec | None) -> str:
    """The algorithm ``algorithm="auto"`` picks for this communicator and codec."""
    if comm.size == 1:
        return "identity"
    if comm.inter_size > 1 and comm.intra_size > 1 and uniform_nodes(comm):
        return "hierarchical"
    if codec is None or _native_ok(comm, codec):
        return "native"
    return "scatter_reduce"


def _check(comm: Communicator, flat: torch.Tensor, codec: Codec | None, algorithm: str) -> None:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("allreduce needs a contiguous 1-D tensor (flatten it first)")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if codec is not None:
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a commopt Codec or None, got {type(codec).__name__}")
        if flat.dtype != torch.float32:
            raise TypeError(f"codecs encode float32 buffers; got {flat.dtype} (use codec=None)")
    if algorithm == "native" and codec is not None and not _native_ok(comm, codec):
        raise ValueError(
            f"algorithm='native' needs a linear codec whose wire dtype the transport sums; "
            f"codec {codec.name} (linear={codec.linear}, wire {codec.wire_dtype}) on "
            f"{type(comm).__name__}: use algorithm='scatter_reduce' or 'auto'"
        )
    if algorithm == "hierarchical" and not uniform_nodes(comm):
        raise ValueError(
            "algorithm='hierarchical' needs the same number of ranks on every node; "
            f"nodes here: {getattr(comm, 'node_names', '?')}. Use algorithm='auto'."
        )


# -- public entry ---------------------------------------------------------------------------
def allreduce(
    comm: Communicator,
    flat: torch.Tensor,
    codec: Codec | None = None,
    *,
    average: bool = True,
    algorithm: str = "auto",
    async_op: bool = False,
    scale: float = 1.0,
    rng: RngKey | None = None,
    key: str | None = None,
    piece_bytes: int | None = None,
) -> Work:
    """Reduce ``flat`` over all ranks of ``comm`` through ``codec``, in place.

    ``codec=None`` reduces exactly in ``flat``'s own dtype. ``scale`` multiplies the
    result (applied before encoding, with the 1/size of ``average``). ``rng`` keys the
    random numbers of stochastic codecs (each chunk gets its own stream); ``key`` names the
    buffer for stateful codecs (error feedback keeps one residual per key and chunk).
    ``piece_bytes``: fp32 bytes per piece of the scatter-reduce pipeline (default
    :data:`PIECE_BYTES`; 0 runs the whole buffer as one piece).
    Returns a Work; with ``async_op=False`` it is already complete.
    """
    _check(comm, flat, codec, algorithm)
    if algorithm == "auto":
        algorithm = choose_algorithm(comm, codec)
    factor = float(scale) / comm.size if average else float(scale)
    if flat.numel() == 0:
        return _DONE
    if algorithm == "identity":
        if comm.size != 1:
            raise ValueError("algorithm='identity' is only valid for a world of one")
        if factor != 1.0:
            flat.mul_(factor)
        return _DONE
    plan = _PLANS[algorithm](comm, flat, codec or _Exact(flat.dtype), factor, rng, key,
                             piece_bytes)
    # The stages run on the communicator's worker (a world of one: at once, here).
    work = driver.submit(comm, plan, device=flat.device)
    if not async_op:
        work.wait()
    return work


# Each plan returns a callable that runs the reduction (on the driver thread, or at once);
# the native plan encodes on the caller's thread first, the others do all their work later.
def _plan_native(comm, flat, codec, factor, rng, key, piece_bytes=None) -> Callable[[], None]:
    if codec.wire_dtype == flat.dtype:
        # A cast to the buffer's own dtype is the identity: reduce the buffer in place.
        if factor != 1.0:
            flat.mul_(factor)
        return lambda: comm.allreduce(flat)
    wire = torch.empty(codec.encoded_nbytes(flat.numel()), dtype=torch.uint8, device=flat.device)
    codec.encode(flat, wire, scale=factor, rng=rng, key=key)

    def finish() -> None:
        comm.allreduce(wire.view(codec.wire_dtype))
        codec.decode(wire, flat, accumulate=False)

    return finish


def scatter_reduce_layout(numel: int, size: int, alignment: int = 1,
                          piece_elems: int | None = None) -> list[list[tuple[int, int]]]:
    """Pieces of the scatter-reduce pipeline, each a list of ``size`` chunks (rank j owns j).

    The buffer is cut into pieces of about ``piece_elems`` elements (one piece when None),
    each piece into one chunk per rank, every chunk starting at a multiple of ``alignment``:

        >>> scatter_reduce_layout(12, 2, 1, piece_elems=6)
        [[(0, 3), (3, 6)], [(6, 9), (9, 12)]]
        >>> scatter_reduce_layout(10, 2, 4, piece_elems=5)  # chunks start at multiples of 4
        [[(0, 4), (4, 8)], [(8, 10), (10, 10)]]
    """
    pieces = 1 if not piece_elems else max(1, math.ceil(numel / int(piece_elems)))
    bounds = chunk_bounds(numel, pieces * size, alignment)
    return [bounds[k * size:(k + 1) * size] for k in range(pieces)]


def _plan_scatter_reduce(comm, flat, codec, factor, rng, key,
                         piece_bytes: int | None = None) -> Callable[[], None]:
    """Scatter-reduce then allgather, pipelined over pieces of ``piece_bytes`` fp32 bytes.

    Per piece: encode the peers' chunks, alltoall, sum the own chunk in fp32, encode it,
    allgather, decode. The transfers of one piece run while the codec works on the
    neighbouring pieces, so a large buffer costs about its wire time plus the codec work of
    one piece, not wire time plus codec work of the whole buffer. The own chunk never
    travels, so it is never encoded: it enters the sum exactly.
    """
    size, rank = comm.size, comm.rank
    piece = PIECE_BYTES if piece_bytes is None else int(piece_bytes)
    layout = scatter_reduce_layout(flat.numel(), size, codec.alignment,
                                   max(1, piece // flat.element_size()) if piece > 0 else None)
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
            return buf[k * span:(k + 1) * span]

        def encode_peers_chunks(k: int) -> None:
            for j, (lo, hi) in enumerate(layout[k]):
                if j != rank and hi > lo:
                    off = k * span + j * slot
                    codec.encode(flat[lo:hi], send[off: off + nbytes(lo, hi)], scale=factor,
                                 rng=_chunk_rng(rng, _PHASE_SCATTER, k * size + j),
                                 key=_sub_key(key, f"rs{k * size + j}"))

        def start_scatter(k: int) -> Work:
            return comm.alltoall(region(send, k), region(recv, k), async_op=True)

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
                    codec.decode_scaled(recv[off: off + nbytes(lo, hi)], mine, accumulate=True,
                                        alpha=undo)
            # recv's own slot never carried data: it becomes the allgather input.
            off = k * span + rank * slot
            codec.encode(mine, recv[off: off + nbytes(lo, hi)], scale=factor,
                         rng=_chunk_rng(rng, _PHASE_GATHER, k), key=_sub_key(key, f"ag{k}"))

        def start_gather(k: int) -> Work:
            # send's piece is free once its alltoall is done: it receives the reduced chunks.
            off = k * span + rank * slot
            return comm.allgather(recv[off: off + slot], region(send, k), async_op=True)

        def decode_piece(k: int) -> None:
            # Every rank, the owner included, decodes the same bytes: identical results.
            for j, (lo, hi) in enumerate(layout[k]):
                if hi > lo:
                    off = k * span + j * slot
                    codec.decode(send[off: off + nbytes(lo, hi)], flat[lo:hi], accumulate=False)

        # Two scatters in flight keep the link busy while piece k is summed and encoded.
        # Every rank issues the transport's collectives in the same order:
        # scatter 0, scatter 1, gather 0, scatter 2, gather 1, ...
        scatters: list[Work | None] = [None] * pieces
        gathers: list[Work | None] = [None] * pieces
        for k in range(min(2, pieces)):
            encode_peers_chunks(k)
            scatters[k] = start_scatter(k)
        for k in range(pieces):
            scatters[k].wait()
            reduce_own_chunk(k)
            gathers[k] = start_gather(k)
            if k + 2 < pieces:
                encode_peers_chunks(k + 2)
                scatters[k + 2] = start_scatter(k + 2)
            if k >= 1:
                gathers[k - 1].wait()
                decode_piece(k - 1)
        gathers[pieces - 1].wait()
        decode_piece(pieces - 1)

    return finish


def _plan_hierarchical(comm, flat, codec, factor, rng, key,
                       piece_bytes=None) -> Callable[[], None]:
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
        intra.alltoall(padded, recv)
        pieces = recv.view(intra.size, shard_len)
        shard = pieces[0].clone()
        for i in range(1, intra.size):
            shard.add_(pieces[i])
        # 2. the compressed algorithm across nodes, on this rank's shard.
        if inter.size > 1:
            inner = choose_algorithm(inter, codec)
            _PLANS[inner](inter, shard, codec, factor, rng, _sub_key(key, "x"), piece_bytes)()
        elif factor != 1.0:
            shard.mul_(factor)
        # 3. allgather inside the node.
        intra.allgather(shard, padded)
        if padded is not flat:
            flat.copy_(padded[:n])

    return finish


_PLANS = {
    "native": _plan_native,
    "scatter_reduce": _plan_scatter_reduce,
    "hierarchical": _plan_hierarchical,
}
