"""The synchronous schedule: each step applies the averages of its own gradients.

:class:`SynchronousSchedule` owns the step in progress (a
:class:`~commopt.optim.step_progress.StepProgress`) and receives the optimizer's events. With
``overlap=True`` each backward hook marks its gradient ready and the reduction sends every
bucket whose gradients are all in (:meth:`~SynchronousSchedule.grad_ready`); the end of
backward finishes the reduction, so ``backward()`` returns with the averages in
``param.grad``, as under DDP. With ``overlap=False`` the gradients stay local until
``step()`` or ``synchronize()`` sends them. :meth:`~SynchronousSchedule.result` hands
``step()`` the agreed result to apply.

    >>> import torch, commopt
    >>> from commopt.optim.bucketed_params import BucketedParameters
    >>> from commopt.optim.reduction_counter import ReductionCounter
    >>> from commopt.optim.schedules.protocol import ScheduleContext
    >>> from commopt.reducer import GradientReducer
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> comm = commopt.create_communicator("local")
    >>> owned = BucketedParameters(lambda i: schedule.grad_ready(i), lambda: schedule.backward_end())
    >>> owned.install(GradientReducer(comm, [w], ["w"]), [w])
    >>> context = ScheduleContext(
    ...     owned, ReductionCounter(), torch.optim.SGD([w], lr=0.1), zero_fill=True,
    ...     ensure_layout=lambda: None, all_params=lambda: [w],
    ... )
    >>> schedule = SynchronousSchedule(context, SynchronousOptions(overlap=False))
    >>> (w * 3).sum().backward(); schedule.stage.value
    'local'
    >>> schedule.synchronize(); schedule.stage.value, w.grad.tolist()
    ('averaged', [3.0, 3.0])
    >>> schedule.result(skip_synchronize=False).nonfinite, schedule.stage.value
    (False, 'idle')
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from commopt.optim.schedules.protocol import (
    ScheduleBase,
    ScheduleContext,
    not_synchronized_error,
)
from commopt.optim.step_progress import Stage, StepProgress
from commopt.reducer import StepReduction, StepResult

__all__ = ["SynchronousOptions", "SynchronousSchedule"]


@dataclass(frozen=True)
class SynchronousOptions:
    """``overlap``: send each bucket during backward as its gradients are ready (True), or
    every bucket in ``step()`` (False)."""

    overlap: bool = True


class SynchronousSchedule(ScheduleBase):
    """Each step's averages are applied by that step (``double_buffering=False``)."""

    name = "synchronous"
    options = SynchronousOptions
    refused_under = "overlap=False"
    checkpoint_keys = ("pending",)

    def __init__(self, context: ScheduleContext, options: SynchronousOptions | None = None):
        super().__init__(context, options)
        # (compression="auto" measures the backward pass alone: sent in step())
        self.overlap = bool(self.settings.overlap) and not context.defer_to_step
        self._ensure_layout = context.ensure_layout
        self._progress = StepProgress()
        self._averaged: list[weakref.ref[torch.Tensor] | None] = []  # .grad after synchronize()

    # -- inspection ---------------------------------------------------------------------------
    @property
    def stage(self) -> Stage:
        """Where this step's gradients are (:class:`~commopt.optim.step_progress.Stage`)."""
        return self._progress.stage

    @property
    def in_flight(self) -> StepReduction | None:
        """The reduction the backward hooks are sending, else None."""
        return self._progress.in_flight

    @property
    def averages(self) -> StepReduction | None:
        """The finished reduction whose averages are in ``param.grad``, not applied yet."""
        return self._progress.averages

    @property
    def started(self) -> bool:
        """Whether this step's reduction started (sending, or averaged and not applied)."""
        return self._progress.started

    @property
    def reads_synchronize(self) -> bool:
        """Whether reading ``param_groups`` now should finish the reduction first."""
        return self._progress.has_local

    def zero_grad_buffer(self) -> int | None:
        """The buffer set ``zero_grad(set_to_none=False)`` may point ``.grad`` at (None: none)."""
        self._drop_unapplied()  # averages not applied (a skipped step) are discarded
        self.guard.clear()
        return None if self._progress.in_flight is not None else 0

    def _drop_unapplied(self) -> None:
        """Forget averages ``step()`` did not apply, once their agreed result is read.

        (Reading it is what discards a skipped step's codec state on stream-ordered
        transports; the averages were written without it.)
        """
        unapplied = self._progress.averages
        if unapplied is not None:
            unapplied.wait()
        self._progress.drop()

    def applied_params(self) -> list[torch.Tensor]:
        """The parameters whose averages the step applies (clipped together)."""
        return self.bucketed.params

    # -- events -------------------------------------------------------------------------------
    def grad_ready(self, index: int) -> None:
        """Backward produced parameter ``index``'s gradient (outside ``no_sync()``)."""
        progress = self._progress
        progress.wrote()
        if not self.overlap:
            return
        owned = self.bucketed
        if progress.in_flight is None:
            if progress.averages is not None and self._adds_to_averages(index):
                # The averages were not applied (GradScaler skipped the step) and this backward
                # adds to them; a gradient set to None (model.zero_grad()) starts afresh.
                raise RuntimeError(
                    "a second backward() before step(): the gradients of the first were "
                    "averaged already. Call optimizer.zero_grad() between steps; for gradient "
                    "accumulation, run all but the last backward inside `with "
                    "optimizer.no_sync():`."
                )
            self._drop_unapplied()
            progress.send(self.counter.start(owned.reducer))
        red = progress.in_flight
        assert red is not None  # (sent just above)
        red.mark_ready(index)
        if red.issued == len(owned.reducer.buckets):
            # Every gradient is in, though perhaps inside a nested (reentrant checkpoint)
            # backward: finishing at its end is safe, as DDP's reducer does.
            owned.hooks.queue_end()

    def _adds_to_averages(self, index: int) -> bool:
        """Whether parameter ``index``'s gradient is still the tensor synchronize() left."""
        ref = self._averaged[index] if index < len(self._averaged) else None
        grad = self.bucketed.params[index].grad
        return ref is not None and grad is not None and ref() is grad

    def backward_end(self) -> None:
        """End of a backward outside ``no_sync()``: with overlap, finish the reduction now.

        Otherwise the gradients stay local until ``step()``: remember their version
        counters, so that ``step()`` can tell a write (a clip) before the reduction.
        """
        if self.overlap:
            self.synchronize(explicit=True)
        else:
            self.guard.record(self.bucketed.params)

    def synchronize(self, explicit: bool = True) -> None:
        """Finish this step's reduction (or send it all now): the averages land in ``param.grad``."""
        if explicit:
            self.guard.clear()  # the gradients in .grad now are the ones to send
        progress = self._progress
        if progress.stage is Stage.AVERAGED:
            return  # already averaged since the last backward
        self._ensure_layout()
        owned = self.bucketed
        if progress.averages is not None:
            progress.averages.wait()  # unapplied averages collect() drops: their result is read
        red = progress.collect()  # the one the hooks are sending, if any
        if red is None:
            red = self.counter.start(owned.reducer)
        red.issue_remaining()
        # zero_fill=True writes the averages without reading anything on the host: the
        # agreed result (NaN/Inf skip) is read in step(), where it is needed.
        red.write_averages(self.zero_fill)
        progress.averaged(red)
        self._averaged = [  # (the second-backward check)
            None if p.grad is None else weakref.ref(p.grad) for p in owned.params
        ]

    def result(
        self, *, skip_synchronize: bool, scale: Any = None, found_inf: Any = None
    ) -> StepResult | None:
        """The result ``step()`` applies: this step's (averaged now unless ``synchronize()`` did).

        (GradScaler's ``scale`` and ``found_inf`` play no part: it unscaled ``param.grad``.)
        """
        if self._progress.stage is not Stage.AVERAGED:
            if skip_synchronize:
                raise not_synchronized_error()
            self._check_no_local_writes()
            self.synchronize(explicit=True)
        return self._progress.take().result()

    def discard(self) -> None:
        """The gradients of the evaluation are consumed (``step(closure)``)."""
        self._drop_unapplied()
        self.guard.clear()

    def before_layout_change(self) -> None:
        """A reduction the hooks left in flight belongs to the old buckets: forget it.

        (The optimizer drained it first.) The gradients count as local again, and the next
        synchronize sends them with the new layout.
        """
        if self._progress.in_flight is not None:
            self._progress.reset()

    # -- checkpoint, close --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"pending": None}

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        self._progress.reset()
        if state.get("pending") is not None:
            raise ValueError(
                "the checkpoint holds pending double-buffered gradients: load it into an "
                "optimizer with double_buffering=True or 'stale' (a schedule that keeps a "
                "reduction pending), or call flush() before saving"
            )
        from commopt.optim.compensation import refuse_prediction

        refuse_prediction(state)

    def close(self) -> None:
        self._progress.reset()
