"""StepReduction: one step's gradients on their way to the average, bucket by bucket.

Buckets are issued strictly in order (bucket ``i`` after ``0..i-1``), whatever order the
backward hooks report gradients in, so every rank issues the same collectives in the same
order; ``issue_remaining()`` issues what is left and the agreement trailer
(:mod:`commopt.reducer.agreement`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from commopt import driver
from commopt.comm.base import CompletedWork as _DoneWork
from commopt.comm.base import Work
from commopt.reducer.agreement import StepResult, agree, has_nonfinite

if TYPE_CHECKING:  # the reducer starts steps: it imports this module
    from commopt.reducer.gradient_reducer import GradientReducer

__all__ = ["StepReduction"]


class StepReduction:
    """One step's gradients on their way to the average, bucket by bucket, in order."""

    def __init__(self, reducer: GradientReducer, step: int, buffer: int, scale: float):
        self.reducer = reducer
        self.step = step
        self.buffer = buffer
        self.scale = float(scale)
        self.flats = reducer.buffers[buffer]
        n = len(reducer.buckets)
        self._waiting = [len(b.slots) for b in reducer.buckets]
        self._fired = [False] * len(reducer.params)
        self._bad: list[torch.Tensor | bool | None] = [None] * n
        self.present = [False] * len(reducer.params)
        self.issued = 0  # buckets 0..issued-1 are on their way
        self.works: list[Work] = []
        self._trailer: Work | None = None
        self._result: StepResult | None = None
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
        self.works.append(self.reducer.reduce(bucket, flat, self.step, self.scale))
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
        """On the worker, after every bucket: agree on NaN/Inf and presence (the trailer)."""
        self._result = agree(
            self.reducer.comm, self.reducer.buckets, self.flats, self._bad, self.present, self.scale
        )
        if self._result.nonfinite:  # every rank skips it: leave no trace in codec state
            self.reducer.discard_step()

    # -- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The completed reduction (waits for it): its step, averaged buckets and agreed result.

        What a checkpoint keeps of a reduction still pending under double buffering;
        :meth:`load_state_dict` on a fresh StepReduction of the same buckets restores it.
        """
        result = self.wait()
        return {
            "step": self.step,
            "flats": [f.detach().clone().cpu() for f in self.flats],
            "result": {
                "nonfinite": result.nonfinite,
                "bad_buckets": list(result.bad_buckets),
                "present": list(result.present),
            },
        }

    def load_state_dict(self, state: dict) -> None:
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
        self.step = int(state["step"])
        self.issued = len(self.reducer.buckets)
        self.present = list(result.present)
        self._result = result
        self._trailer = _DoneWork()
        self.all_issued = True

    # -- completing --------------------------------------------------------------------------
    def done(self) -> bool:
        return self._trailer is not None and self._trailer.is_completed()

    def wait(self) -> StepResult:
        """Wait for every bucket and the trailer (call ``issue_remaining`` first)."""
        if not self.all_issued:
            raise RuntimeError("StepReduction.wait() before issue_remaining()")
        for w in self.works:
            w.wait()
        if self._trailer is None:
            raise RuntimeError("StepReduction: issue_remaining() queued no trailer")
        self._trailer.wait()
        if self._result is None:
            raise RuntimeError("StepReduction: the trailer finished without an agreed result")
        return self._result

    def unpack(self, zero_fill: bool) -> StepResult:
        """Write the averaged gradients into ``param.grad``; returns the agreed result.

        ``zero_fill=False`` leaves ``grad`` None for parameters no rank had a gradient for.
        A bucket that held NaN/Inf on any rank is written as NaN on every rank if its
        average came out finite, so anything that inspects gradients (GradScaler) sees it.
        """
        result = self.wait()
        keep = [True] * len(self.present) if zero_fill else result.present
        for i, bucket in enumerate(self.reducer.buckets):
            flat = self.flats[i]
            if i in result.bad_buckets and not has_nonfinite(flat):
                for s in bucket.slots:
                    flat[s.offset : s.offset + s.numel].fill_(float("nan"))
            self.reducer.unpack(bucket, flat, keep)
        return result
