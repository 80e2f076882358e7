"""StepReduction: one step's gradients on their way to the average, bucket by bucket.

Buckets are issued strictly in order (bucket ``i`` after ``0..i-1``), whatever order the
backward hooks report gradients in, so every rank issues the same collectives in the same
order; ``issue_remaining()`` issues what is left and the agreement trailer
(:mod:`commopt.reducer.agreement`).

Nothing here reads a device value on the host while issuing. The agreed result is read by
:meth:`StepReduction.result` (or :meth:`~StepReduction.wait`), where the caller needs it;
:meth:`~StepReduction.write_averages` hands the averages to ``param.grad`` without reading
anything when every parameter gets a gradient (``zero_fill=True``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from commopt import driver, kernels
from commopt.comm.base import Communicator, Work
from commopt.comm.base import CompletedWork as _DoneWork
from commopt.profiling import phase
from commopt.reducer.agreement import Agreement, StepResult, issue_agreement
from commopt.reducer.layout import Bucket

__all__ = ["BucketReducer", "StepReduction"]


class BucketReducer(Protocol):
    """What a step's reduction uses of its reducer (:class:`~commopt.reducer.GradientReducer`)."""

    comm: Communicator
    params: list[torch.Tensor]
    names: list[str]
    buckets: list[Bucket]
    bucket_of: list[int]
    buffers: list[list[torch.Tensor]]

    def pack(
        self, bucket: Bucket, flat: torch.Tensor, present: list[bool]
    ) -> torch.Tensor | bool: ...

    def reduce(self, bucket: Bucket, flat: torch.Tensor, number: int, scale: float) -> Work: ...

    def unpack(self, bucket: Bucket, flat: torch.Tensor, keep: Sequence[bool]) -> None: ...

    def discard_step(self) -> None: ...


class StepReduction:
    """One step's gradients on their way to the average, bucket by bucket, in order."""

    def __init__(
        self, reducer: BucketReducer, number: int, buffer: int, scale: float | torch.Tensor
    ):
        self.reducer = reducer
        self.number = number  # the reduction number: the codecs' random key
        self.buffer = buffer
        # A tensor scale (GradScaler's, on the device) multiplies each bucket as it is packed,
        # with no host read; the collective then scales by 1.
        self._grad_factor = scale if isinstance(scale, torch.Tensor) else None
        self.scale = 1.0 if self._grad_factor is not None else float(scale)
        self.flats = reducer.buffers[buffer]
        n = len(reducer.buckets)
        self._waiting = [len(b.slots) for b in reducer.buckets]
        self._fired = [False] * len(reducer.params)
        self._bad: list[torch.Tensor | bool | None] = [None] * n
        self.present = [False] * len(reducer.params)
        self.issued = 0  # buckets 0..issued-1 are on their way
        self.works: list[Work] = []
        self._trailer: Work | None = None
        self._agreement: Agreement | None = None
        self._result: StepResult | None = None
        self._written: list[bool] | None = None  # keep-mask of write_averages, once written
        self.all_issued = False

    # -- issuing ---------------------------------------------------------------------------
    def mark_ready(self, param: int) -> None:
        """The gradient of ``param`` is final for this step (called from backward hooks)."""
        b = self.reducer.bucket_of[param]
        if self._fired[param]:
            if b < self.issued:
                raise RuntimeError(
                    f"the gradient of {self.reducer.names[param]!r} changed after its bucket was "
                    "sent (a second backward before step()). For gradient accumulation, run "
                    "all but the last backward inside `with optimizer.no_sync():`."
                )
            return
        self._fired[param] = True
        self._waiting[b] -= 1
        while self.issued < len(self._waiting) and self._waiting[self.issued] == 0:
            self._issue(self.issued)

    def _issue(self, i: int) -> None:
        bucket = self.reducer.buckets[i]
        flat = self.flats[i]
        self._bad[i] = self.reducer.pack(bucket, flat, self.present)
        if self._grad_factor is not None:
            flat.mul_(self._grad_factor)
        self.works.append(self.reducer.reduce(bucket, flat, self.number, self.scale))
        self.issued = i + 1

    def issue_remaining(self) -> None:
        """Issue the buckets not sent yet (unused parameters: zeros) and the trailer."""
        if self.all_issued:
            return
        while self.issued < len(self.reducer.buckets):
            self._issue(self.issued)
        device = self.flats[0].device if self.flats else None
        self._trailer = driver.then(self.reducer.comm, self._agree, device=device)
        self.all_issued = True

    def _agree(self) -> None:
        """After every bucket: agree on NaN/Inf and presence (the trailer).

        On a host-ordered transport this runs on the worker, which reads the result at once;
        on a stream-ordered one it only enqueues, and :meth:`wait` reads the result.
        """
        with phase("agree"):
            self._agreement = issue_agreement(
                self.reducer.comm,
                self.reducer.buckets,
                self.flats,
                self._bad,
                self.present,
                None if self._grad_factor is not None else self.scale,
            )
            if not getattr(self.reducer.comm, "stream_ordered", False):
                self._resolve()

    def _resolve(self) -> StepResult:
        if self._result is None:
            if self._agreement is None:
                raise RuntimeError("StepReduction: the trailer finished without an agreed result")
            self._result = self._agreement.result()
            if self._result.nonfinite:  # every rank skips it: leave no trace in codec state
                self.reducer.discard_step()
        return self._result

    def local_nonfinite(self) -> torch.Tensor | bool:
        """Whether this rank's packed gradients held NaN/Inf (before any reduction).

        A device tensor where packing ran on the device (no host read), else a bool.
        """
        flags = [b for b in self._bad if isinstance(b, torch.Tensor)]
        host = any(b for b in self._bad if isinstance(b, bool))
        if not flags:
            return host
        found = torch.stack([f.reshape(()) for f in flags]).any()
        return found | host if host else found

    # -- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The completed reduction (waits for it): its number, averaged buckets, agreed result.

        What a checkpoint keeps of a reduction still pending under double buffering;
        :meth:`load_state_dict` on a fresh StepReduction of the same buckets restores it.
        """
        result = self.wait()
        return {
            "reduction": self.number,
            "flats": [f.detach().clone().cpu() for f in self.flats],
            "result": {
                "nonfinite": result.nonfinite,
                "bad_buckets": list(result.bad_buckets),
                "present": list(result.present),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Become the completed reduction ``state`` describes (from :meth:`state_dict`)."""
        flats = state["flats"]
        if len(flats) != len(self.flats) or any(
            a.numel() != b.numel() for a, b in zip(flats, self.flats)
        ):
            raise ValueError(
                "the checkpoint's pending gradients do not match this model's buckets "
                "(different model, bucket_cap_mb or compression?)"
            )
        res = state["result"]
        result = StepResult(bool(res["nonfinite"]), list(res["bad_buckets"]), list(res["present"]))
        for dst, src in zip(self.flats, flats):
            dst.copy_(src.to(dst.device))
        # (state versions 1 and 2 saved the number as "step")
        self.number = int(state["reduction"] if "reduction" in state else state["step"])
        self.issued = len(self.reducer.buckets)
        self.present = list(result.present)
        self._result = result
        self._trailer = _DoneWork()
        self.all_issued = True

    # -- completing --------------------------------------------------------------------------
    def done(self) -> bool:
        return self._trailer is not None and self._trailer.is_completed()

    def _order_after(self) -> None:
        """Order the caller after every bucket and the trailer (host-ordered: wait for them)."""
        if not self.all_issued:
            raise RuntimeError("StepReduction.wait() before issue_remaining()")
        if self._trailer is None:
            raise RuntimeError("StepReduction: issue_remaining() queued no trailer")
        with phase("wait"):
            for w in self.works:
                w.wait()
            self._trailer.wait()

    def wait(self) -> StepResult:
        """Wait for every bucket and the trailer, and read the agreed result."""
        self._order_after()
        with phase("wait"):
            return self._resolve()

    def write_averages(self, zero_fill: bool) -> None:
        """Write the averaged gradients into ``param.grad``.

        ``zero_fill=True``: every parameter gets its average (zeros where no rank had a
        gradient) and nothing is read on the host: on a stream-ordered transport the
        caller's stream is ordered after the reduction. ``zero_fill=False`` leaves ``grad``
        None for parameters no rank had a gradient for, which needs the agreed result.
        """
        if zero_fill:
            self._order_after()
            keep = [True] * len(self.present)
        else:
            keep = self.wait().present
        self._mark_bad_buckets()
        for i, bucket in enumerate(self.reducer.buckets):
            self.reducer.unpack(bucket, self.flats[i], keep)
        self._written = keep

    def _mark_bad_buckets(self) -> None:
        """A bucket that held NaN/Inf on some rank becomes NaN on every rank if its average
        came out finite, so whatever inspects the gradients (GradScaler) sees it.

        With the result known on the host (host-ordered transports: the worker read it) the
        bad buckets are filled; else each bucket adds its device mark (NaN if bad, -0.0,
        the exact identity, if not) in stream order, with no host read.
        """
        marks = self._agreement.marks if self._agreement is not None else None
        if self._result is not None or marks is None:
            for i in self._resolve().bad_buckets:
                flat = self.flats[i]
                if not kernels.any_nonfinite((flat,)):
                    for s in self.reducer.buckets[i].slots:
                        flat[s.offset : s.offset + s.numel].fill_(float("nan"))
            return
        streams = self.reducer.comm.streams  # type: ignore[attr-defined]  # stream-ordered
        streams.keep(marks, streams.current(marks.device))
        for i, flat in enumerate(self.flats):
            flat.add_(marks[i])

    def result(self) -> StepResult:
        """The agreed result, with the averages written (see :meth:`unpack`)."""
        if self._written is None:
            raise RuntimeError("StepReduction.result() before write_averages()")
        return self.wait()

    def unpack(self, zero_fill: bool) -> StepResult:
        """Write the averaged gradients into ``param.grad``; returns the agreed result.

        ``zero_fill=False`` leaves ``grad`` None for parameters no rank had a gradient for.
        A bucket that held NaN/Inf on any rank is written as NaN on every rank if its
        average came out finite, so anything that inspects gradients (GradScaler) sees it.
        """
        self.write_averages(zero_fill)
        return self.result()
