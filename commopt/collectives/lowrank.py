"""The low-rank plan: PowerSGD's two allreduces with the codec's math between them.

Every rank sums its P's (and the values the codec sends exactly) with one allreduce, the
codec orthogonalises the summed P's and forms the Q's, a second allreduce sums the Q's, and
the codec writes ``P @ Q.T`` into the buffer. Both sums are the transport's own float32
allreduce (every transport has one), so the plan works on host-ordered communicators (run on
the communicator's worker, :mod:`commopt.driver`) and on stream-ordered ones (enqueued on
the communicator's stream: the codec's math is tensor operations on the buffer's device
and reads nothing back to the host). Everything runs inside the returned callable, in
issue order: a bucket's warm-start Q and residual are read after the previous reduction of
the same bucket has written them, also with double buffering. During the codec's warm-up
(``start_iter``) the plan is one float32 allreduce of the whole buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commopt.codecs.base import RngKey
from commopt.codecs.lowrank import PowerSGD
from commopt.comm.base import Communicator

__all__ = ["plan_lowrank"]


def plan_lowrank(
    comm: Communicator,
    flat: torch.Tensor,
    codec: PowerSGD,
    factor: float,
    rng: RngKey | None,
    key: str | None,
    shapes: Sequence[tuple[int, Sequence[int]]] | None,
) -> Callable[[], None]:
    if shapes is None:
        raise ValueError(
            f"the {codec.name} codec compresses whole matrices and needs their shapes: call "
            "allreduce(..., shapes=[(offset, shape), ...]) with each tensor's place in the "
            "buffer (the reducer and the optimizer wrapper pass them)"
        )
    shapes = [(int(off), tuple(int(d) for d in shape)) for off, shape in shapes]
    codec.placement(flat.numel(), shapes)  # bad shapes fail here, on the caller's thread
    number = rng.reduction if rng is not None else None
    warm = codec.warming_up(number)  # (raises here, on the caller's thread, without a number)

    def finish() -> None:
        if warm:  # warm-up: one plain float32 allreduce of everything
            codec.begin_uncompressed(number)  # type: ignore[arg-type]
            if factor != 1.0:
                flat.mul_(factor)
            comm.allreduce(flat)
            return
        job = codec.start(flat, shapes, key=key, factor=factor, size=comm.size, reduction=number)
        if job.p.numel():
            comm.allreduce(job.p)
        q = job.after_p_sum()
        if q.numel():
            comm.allreduce(q)
        job.after_q_sum()

    return finish
