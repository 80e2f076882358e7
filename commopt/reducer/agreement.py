"""The trailer of a step's reduction: every rank agrees on NaN/Inf and on presence.

After a step's buckets, one small allreduce of flags tells every rank which buckets held
NaN/Inf on any rank and which parameters had a gradient on any rank, so all ranks take the
same decisions (skip the step, leave ``grad`` None).

Issuing the trailer and reading its flags are two moments. :func:`issue_agreement` enqueues
the flags' allreduce behind the buckets' and returns an :class:`Agreement`; its
:meth:`~Agreement.result` reads the flags on the host. On host-ordered transports the trailer
runs on the communicator's worker thread, which reads them at once. On stream-ordered ones
(NCCL) the calling thread issues everything: the local flags are combined on the device, the
agreed flags are copied to pinned host memory behind the allreduce, and nothing is read until
the step's result is needed, so issuing never waits for the transfers ahead of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from commopt import kernels
from commopt.codecs.base import Codec
from commopt.comm.base import Communicator
from commopt.reducer.layout import Bucket

__all__ = ["Agreement", "StepResult", "agree", "issue_agreement", "may_overflow"]


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
    bad: Sequence[torch.Tensor | bool | None],
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
    return issue_agreement(comm, buckets, flats, bad, present, scale).result()


class Agreement:
    """The agreed flags of one trailer: where they are, and how to read them once.

    ``flags`` holds, per bucket, whether it held NaN/Inf on some rank and then, per
    parameter, whether some rank had its gradient (> 0: yes). ``event``: the flags are
    valid on the host only after it (stream-ordered transports); None: valid now.
    """

    def __init__(
        self,
        flags: torch.Tensor,
        n_buckets: int,
        event: Any = None,
        streams: Any = None,
        marks: torch.Tensor | None = None,
    ):
        self._flags = flags
        self._n = n_buckets
        self._event = event
        self._streams = streams
        self._result: StepResult | None = None
        #: Per bucket on the device (stream-ordered transports): NaN where the bucket held
        #: NaN/Inf on some rank, -0.0 (adding it changes no bit) elsewhere; else None.
        self.marks = marks

    def result(self) -> StepResult:
        """The agreed result (waits for the flags' copy to the host the first time)."""
        if self._result is None:
            if self._event is not None:
                self._streams.synchronize(self._event)
            agreed = [v > 0 for v in self._flags.tolist()]
            bad_buckets = [i for i in range(self._n) if agreed[i]]
            self._result = StepResult(bool(bad_buckets), bad_buckets, agreed[self._n :])
        return self._result


def issue_agreement(
    comm: Communicator,
    buckets: Sequence[Bucket],
    flats: Sequence[torch.Tensor],
    bad: Sequence[torch.Tensor | bool | None],
    present: Sequence[bool],
    scale: float | None,
) -> Agreement:
    """Enqueue the trailer's allreduce (after the buckets'); read nothing on a GPU path.

    ``scale=None``: the scale is a device tensor (GradScaler's), so every bucket's average
    is checked once more after the reduction.
    """
    n = len(flats)
    # On the buckets' device: a GPU transport (NCCL) reduces device memory only.
    device = flats[0].device if flats else torch.device("cpu")
    if not getattr(comm, "stream_ordered", False):
        # The worker thread runs this after the buckets: reading here costs the host nothing.
        local = [
            float(
                bool(bad[i]) or (_check_after(buckets[i], scale) and kernels.any_nonfinite((flat,)))
            )
            for i, flat in enumerate(flats)
        ]
        local += [float(p) for p in present]
        flags = torch.tensor(local, dtype=torch.float32, device=device)
        comm.allreduce(flags)
        return Agreement(flags, n)
    streams = comm.streams  # type: ignore[attr-defined]  # every stream-ordered one has them
    stream = streams.current(device)  # the communicator's stream: the trailer runs on it
    known = [0.0 if isinstance(b, torch.Tensor) else float(bool(b)) for b in bad]
    flags = streams.from_host(known + [float(p) for p in present], torch.float32, device)
    for i, flat in enumerate(flats):
        flag = bad[i]
        if isinstance(flag, torch.Tensor):  # packed on the caller's stream: keep it for ours
            streams.keep(flag, stream)
            flags[i : i + 1].add_(flag.reshape(1).to(torch.float32))
        if _check_after(buckets[i], scale):
            flags[i : i + 1].add_((~torch.isfinite(flat).all()).reshape(1).to(torch.float32))
    comm.allreduce(flags)
    marks = torch.where(flags[:n] > 0, float("nan"), -0.0)
    host, event = streams.to_host(flags)
    return Agreement(host, n, event, streams, marks)


def _check_after(bucket: Bucket, scale: float | None) -> bool:
    return scale is None or may_overflow(bucket.codec, scale)


def may_overflow(codec: Codec | None, scale: float) -> bool:
    """Whether a bucket's average can be non-finite when every input was finite.

    An average of finite fp32 (or bf16: the same range) terms, each divided by the
    world size before the sum, stays within the largest input, and so does QSGD with
    max-abs float32 scales; but the bytes peers sent are untrusted: a damaged wire can spell
    NaN or Inf in any codec (``Codec.can_overflow``, True for every codec commopt ships) and
    in exact float32 (``codec`` None). Those buckets, and a scale above 1, pay a second pass.
    """
    return scale > 1.0 or codec is None or codec.can_overflow
