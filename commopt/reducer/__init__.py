"""Buckets of gradients -> codec -> collective, synchronously or asynchronously.

The reducer fuses the gradients of a fixed list of parameters into flat float32 buckets
(the same buckets, in the same order, on every rank), reduces each bucket with
:func:`commopt.collectives.allreduce` and writes the averages back into ``param.grad``.
It knows no particular codec: per tensor, the per-layer policy picks the compressing codec
or the uncompressed one, and each bucket holds tensors of one kind only, so one collective
carries one codec. In a compressed bucket every tensor starts at a multiple of the codec's
``alignment``: quantisation buckets never straddle two tensors.

    >>> import torch, commopt
    >>> from commopt.reducer import GradientReducer
    >>> comm = commopt.create_communicator("local")
    >>> w = torch.nn.Parameter(torch.ones(3)); w.grad = torch.full((3,), 2.0)
    >>> reducer = GradientReducer(comm, [w], ["w"])
    >>> reduction = reducer.start(number=0)
    >>> reduction.issue_remaining()
    >>> result = reduction.unpack(zero_fill=True)  # waits, then writes param.grad
    >>> w.grad.tolist(), result.nonfinite
    ([2.0, 2.0, 2.0], False)

One step's reduction (:class:`StepReduction`) issues bucket ``i`` only after buckets
``0..i-1``: ranks whose gradients become ready in a different order (unused parameters,
data-dependent graphs) still issue the transport's collectives in the same order. A final
small allreduce (the "trailer") tells every rank which buckets held NaN/Inf on any rank and
which parameters had a gradient on any rank, so all ranks take the same decisions.

Modules: :mod:`~commopt.reducer.layout` (buckets and slots),
:mod:`~commopt.reducer.gradient_reducer` (buffers; pack, reduce, unpack; codec state),
:mod:`~commopt.reducer.reduction` (one step's ordered reduction),
:mod:`~commopt.reducer.agreement` (the NaN/Inf and presence trailer).
"""

from __future__ import annotations

from commopt.reducer.agreement import StepResult
from commopt.reducer.gradient_reducer import GradientReducer
from commopt.reducer.layout import Bucket, Slot, build_buckets
from commopt.reducer.reduction import StepReduction

__all__ = ["Bucket", "GradientReducer", "Slot", "StepReduction", "StepResult", "build_buckets"]
