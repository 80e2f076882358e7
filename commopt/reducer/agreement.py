"""The trailer of a step's reduction: every rank agrees on NaN/Inf and on presence.

After a step's buckets, one small allreduce of flags tells every rank which buckets held
NaN/Inf on any rank and which parameters had a gradient on any rank, so all ranks take the
same decisions (skip the step, leave ``grad`` None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from commopt import kernels
from commopt.codecs.base import Codec
from commopt.comm.base import Communicator
from commopt.reducer.layout import Bucket

__all__ = ["StepResult", "agree", "may_overflow"]


@dataclass
class StepResult:
    """What every rank agrees on after one step's reduction."""

    nonfinite: bool  # some bucket held NaN/Inf on some rank (or after reduction)
    bad_buckets: list[int]  # indices of those buckets
    present: list[bool]  # per parameter: had a gradient on at least one rank


def agree(
    comm: Communicator,
    buckets: Sequence[Bucket],
    flats: Sequence[torch.Tensor],
    bad: Sequence,
    present: Sequence[bool],
    scale: float,
) -> StepResult:
    """One small allreduce: which buckets held NaN/Inf on any rank, which parameters had a
    gradient on any rank. Runs after the buckets' reductions (on the worker, in order).

    ``bad``: per bucket, the local flag its packing computed (a tensor, or None);
    buckets whose average can overflow although every input was finite (``may_overflow``)
    are checked once more after the reduction.

        >>> import torch, commopt
        >>> from commopt.reducer.layout import build_buckets
        >>> comm = commopt.create_communicator("local")
        >>> buckets = build_buckets([torch.zeros(2)], ["w"], codec=None, plain_codec=None)
        >>> flats = [torch.tensor([1.0, float("inf")])]
        >>> agree(comm, buckets, flats, [torch.tensor(True)], [True], 1.0)
        StepResult(nonfinite=True, bad_buckets=[0], present=[True])
    """
    n = len(flats)
    local = [
        float(bool(bad[i]) or (may_overflow(buckets[i].codec, scale) and has_nonfinite(flat)))
        for i, flat in enumerate(flats)
    ]
    local += [float(p) for p in present]
    # On the buckets' device: a GPU transport (NCCL) reduces device memory only.
    device = flats[0].device if flats else torch.device("cpu")
    flags = torch.tensor(local, dtype=torch.float32, device=device)
    comm.allreduce(flags)
    agreed = (flags > 0).tolist()
    bad_buckets = [i for i in range(n) if agreed[i]]
    return StepResult(bool(bad_buckets), bad_buckets, agreed[n:])


def may_overflow(codec: Codec | None, scale: float) -> bool:
    """Whether a bucket's average can be non-finite when every input was finite.

    An average of finite fp32 (or bf16: the same range) terms, each divided by the
    world size before the sum, stays within the largest input, and so does QSGD with
    max-abs float32 scales; but the bytes peers sent are untrusted: a damaged wire can spell
    NaN or Inf in any codec (``Codec.can_overflow``, True for every codec commopt ships) and
    in exact float32 (``codec`` None). Those buckets, and a scale above 1, pay a second pass.
    """
    return scale > 1.0 or codec is None or codec.can_overflow


def has_nonfinite(flat: torch.Tensor) -> bool:
    """Whether ``flat`` holds a NaN or Inf (exact: huge finite values are no false alarm).

    >>> import torch
    >>> has_nonfinite(torch.tensor([3e38, 3e38])), has_nonfinite(torch.tensor([float("nan")]))
    (False, True)
    """
    if flat.device.type == "cpu" and flat.dtype == torch.float32 and flat.is_contiguous():
        return kernels.nonfinite(flat)  # one native pass, no temporary
    return not bool(torch.isfinite(flat).all())
