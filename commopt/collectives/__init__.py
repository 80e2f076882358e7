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

Algorithms (``algorithm=``; chosen in :mod:`~commopt.collectives.choice`, built in
:mod:`~commopt.collectives.plans`, chunked by :mod:`~commopt.collectives.layout`):

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
    The intra/inter communicators are built once per communicator (:mod:`commopt.comm.topology`).
``lowrank``
    the low-rank codec's plan (:class:`~commopt.codecs.PowerSGD`, :mod:`~commopt.collectives.lowrank`):
    two float32 allreduces (P, then Q) with the codec's math between them. It needs
    ``shapes``, the place and shape of each tensor in ``flat``.
``auto`` (default)
    identity for a world of one, lowrank for a low-rank codec, hierarchical when there are
    several nodes with the same number (> 1) of ranks each, else native when possible, else
    scatter_reduce.

Averaging (``average=True``) divides by the world size *before* encoding, so a 16-bit sum
cannot overflow where the mean would not.

Asynchrony: ``async_op=True`` returns a :class:`~commopt.comm.base.Work` at once; the
reduction runs on the communicator's worker (:mod:`commopt.driver`), in issue order, so every rank issues
the transport's collectives in the same order. On a stream-ordered communicator (pure_nccl,
torch with nccl) the reduction is enqueued at once by the calling thread on the
communicator's CUDA stream, after the caller's current stream, and ``wait()`` orders the
caller's current stream after it. ``flat`` belongs to the reduction until
the Work completes (native cast codecs encode on the calling thread). Do not call the
communicator's own collectives while an asynchronous allreduce is in flight: wait first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commopt import driver
from commopt.codecs.base import Codec, RngKey
from commopt.codecs.exact import Exact
from commopt.collectives.choice import ALGORITHMS, check_arguments, choose_algorithm
from commopt.collectives.layout import PIECE_BYTES, chunk_bounds, scatter_reduce_layout
from commopt.collectives.lowrank import plan_lowrank
from commopt.collectives.plans import PLANS
from commopt.comm.base import Communicator, CompletedWork, Work

__all__ = [
    "ALGORITHMS",
    "PIECE_BYTES",
    "allreduce",
    "choose_algorithm",
    "chunk_bounds",
    "scatter_reduce_layout",
]

_DONE = CompletedWork()


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
    shapes: Sequence[tuple[int, Sequence[int]]] | None = None,
) -> Work:
    """Reduce ``flat`` over all ranks of ``comm`` through ``codec``, in place.

    ``codec=None`` reduces exactly in ``flat``'s own dtype. ``scale`` multiplies the
    result (applied before encoding, with the 1/size of ``average``). ``rng`` keys the
    random numbers of stochastic codecs (each chunk gets its own stream); ``key`` names the
    buffer for stateful codecs (error feedback keeps one residual per key and chunk).
    ``piece_bytes``: fp32 bytes per piece of the scatter-reduce pipeline and of a cast
    codec's (fp16, bf16) native plan (default
    :data:`PIECE_BYTES`; 0 runs the whole buffer as one piece). ``shapes``: ``(offset,
    shape)`` of each tensor in ``flat``, for codecs that compress whole matrices (low-rank);
    the others ignore it.
    Returns a Work; with ``async_op=False`` it is already complete.
    """
    check_arguments(comm, flat, codec, algorithm)
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
    if algorithm == "lowrank":
        plan = plan_lowrank(comm, flat, codec, factor, rng, key, shapes)  # type: ignore[arg-type]
    else:
        plan = PLANS[algorithm](
            comm, flat, codec or Exact(flat.dtype), factor, rng, key, piece_bytes
        )
    # The stages run on the communicator's worker (a world of one: at once, here); on a
    # stream-ordered communicator at once, here, enqueued on its stream.
    work = driver.submit(comm, plan, device=flat.device, keep=(flat,))
    if not async_op:
        work.wait()
    return work
