"""The synchronous schedule: each step applies the averages of its own gradients.

:class:`SynchronousSchedule` owns the step in progress (a
:class:`~commopt.optim.step_state.StepState`) and receives the optimizer's events. With
``overlap=True`` each backward hook marks its gradient ready and the reduction sends every
bucket whose gradients are all in (:meth:`~SynchronousSchedule.grad_ready`); the end of
backward finishes the reduction, so ``backward()`` returns with the averages in
``param.grad``, as under DDP. With ``overlap=False`` the gradients stay local until
``step()`` or ``synchronize()`` sends them. :meth:`~SynchronousSchedule.result` hands
``step()`` the agreed result to apply.

    >>> import torch, commopt
    >>> from commopt.optim.bucketed_params import BucketedParameters
    >>> from commopt.optim.reduction_counter import ReductionCounter
    >>> from commopt.reducer import GradientReducer
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> comm = commopt.create_communicator("local")
    >>> schedule = SynchronousSchedule(
    ...     ReductionCounter(), overlap=False, zero_fill=True, ensure_layout=lambda: None
    ... )
    >>> owned = BucketedParameters(schedule.grad_ready, schedule.backward_end)
    >>> owned.install(GradientReducer(comm, [w], ["w"]), [w]); schedule.attach(owned)
    >>> (w * 3).sum().backward(); schedule.stage.value
    'local'
    >>> schedule.synchronize(); schedule.stage.value, w.grad.tolist()
    ('averaged', [3.0, 3.0])
    >>> schedule.result(skip_synchronize=False).nonfinite, schedule.stage.value
    (False, 'idle')
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from commopt.optim.reduction_counter import ReductionCounter
from commopt.optim.schedule_base import ScheduleBase
from commopt.optim.step_state import Stage, StepState
from commopt.reducer import StepReduction, StepResult

__all__ = ["SynchronousSchedule", "not_synchronized_error"]


def not_synchronized_error() -> RuntimeError:
    """``step()`` inside ``skip_synchronize()`` before this step's gradients were averaged."""
    return RuntimeError(
        "step() inside optimizer.skip_synchronize() but the gradients of this step were not "
        "averaged yet: call optimizer.synchronize() after backward() and before step()"
    )


class SynchronousSchedule(ScheduleBase):
    """Each step's averages are applied by that step (``double_buffering=False``)."""

    double_buffered = False
    refused_under = "overlap=False"
    #: the ``double_buffering=`` value this schedule implements
    mode: bool | str = False
    supports_closures = True
    #: GradScaler unscales ``param.grad`` itself (after the averages landed).
    unscales_locally = False

    def __init__(
        self,
        counter: ReductionCounter,
        *,
        overlap: bool,
        zero_fill: bool,
        ensure_layout: Callable[[], None],
    ) -> None:
        self.counter = counter
        self.overlap = bool(overlap)
        self.zero_fill = bool(zero_fill)
        self._ensure_layout = ensure_layout
        super().__init__()
        self._state = StepState()
        self._averaged: list = []  # param.grad as the last synchronize() left them

    # -- inspection ---------------------------------------------------------------------------
    @property
    def stage(self) -> Stage:
        """Where this step's gradients are (:class:`~commopt.optim.step_state.Stage`)."""
        return self._state.stage

    @property
    def in_flight(self) -> StepReduction | None:
        """The reduction the backward hooks are sending, else None."""
        return self._state.in_flight

    @property
    def averages(self) -> StepReduction | None:
        """The finished reduction whose averages are in ``param.grad``, not applied yet."""
        return self._state.averages

    @property
    def started(self) -> bool:
        """Whether this step's reduction started (sending, or averaged and not applied)."""
        return self._state.started

    @property
    def reads_synchronize(self) -> bool:
        """Whether reading ``param_groups`` now should finish the reduction first."""
        return self._state.has_local

    def zero_grad_buffer(self) -> int | None:
        """The buffer set ``zero_grad(set_to_none=False)`` may point ``.grad`` at (None: none)."""
        self._drop_unapplied()  # averages not applied (a skipped step) are discarded
        self.guard.clear()
        return None if self._state.in_flight is not None else 0

    def _drop_unapplied(self) -> None:
        """Forget averages ``step()`` did not apply, once their agreed result is read.

        (Reading it is what discards a skipped step's codec state on stream-ordered
        transports; the averages were written without it.)
        """
        unapplied = self._state.averages
        if unapplied is not None:
            unapplied.wait()
        self._state.drop()

    def applied_params(self) -> list[torch.Tensor]:
        """The parameters whose averages the step applies (clipped together)."""
        return self.bucketed.params

    # -- events -------------------------------------------------------------------------------
    def grad_ready(self, index: int) -> None:
        """Backward produced parameter ``index``'s gradient (outside ``no_sync()``)."""
        state = self._state
        state.wrote()
        if not self.overlap:
            return
        owned = self.bucketed
        if state.in_flight is None:
            if state.averages is not None and self._adds_to_averages(index):
                # The averages were not applied (GradScaler skipped the step) and this backward
                # adds to them; a gradient set to None (model.zero_grad()) starts afresh.
                raise RuntimeError(
                    "a second backward() before step(): the gradients of the first were "
                    "averaged already. Call optimizer.zero_grad() between steps; for gradient "
                    "accumulation, run all but the last backward inside `with "
                    "optimizer.no_sync():`."
                )
            self._drop_unapplied()
            state.send(self.counter.start(owned.reducer))
        red = state.in_flight
        assert red is not None  # (sent just above)
        red.mark_ready(index)
        if red.issued == len(owned.reducer.buckets) and not owned.hooks.end_queued:
            # Every gradient is in, though inside a nested (reentrant checkpoint) backward:
            # finishing at its end is safe, as DDP's reducer does.
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
        state = self._state
        if state.stage is Stage.AVERAGED:
            return  # already averaged since the last backward
        self._ensure_layout()
        owned = self.bucketed
        if state.averages is not None:
            state.averages.wait()  # unapplied averages collect() drops: their result is read
        red = state.collect()  # the one the hooks are sending, if any
        if red is None:
            red = self.counter.start(owned.reducer)
        red.issue_remaining()
        # zero_fill=True writes the averages without reading anything on the host: the
        # agreed result (NaN/Inf skip) is read in step(), where it is needed.
        red.write_averages(self.zero_fill)
        state.averaged(red)
        self._averaged = [  # (the second-backward check)
            None if p.grad is None else weakref.ref(p.grad) for p in owned.params
        ]

    def result(
        self, *, skip_synchronize: bool, scale: Any = None, found_inf: Any = None
    ) -> StepResult | None:
        """The result ``step()`` applies: this step's (averaged now unless ``synchronize()`` did).

        (GradScaler's ``scale`` and ``found_inf`` play no part: it unscaled ``param.grad``.)
        """
        if self._state.stage is not Stage.AVERAGED:
            if skip_synchronize:
                raise not_synchronized_error()
            self._check_no_local_writes()
            self.synchronize(explicit=True)
        return self._state.take().result()

    def after_step(self, result: StepResult | None, max_norm: float | None) -> None:
        """Nothing to do after the inner step."""

    def discard(self) -> None:
        """The gradients of the evaluation are consumed (``step(closure)``)."""
        self._drop_unapplied()
        self.guard.clear()

    def flush(self) -> StepResult | None:
        return None  # nothing is ever pending

    def before_layout_change(self) -> None:
        """A reduction the hooks left in flight belongs to the old buckets: forget it.

        (The optimizer drained it first.) The gradients count as local again, and the next
        synchronize sends them with the new layout.
        """
        if self._state.in_flight is not None:
            self._state.reset()

    @contextlib.contextmanager
    def true_weights(self) -> Iterator[None]:
        yield  # the model always holds the true weights

    # -- checkpoint, close --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"double_buffering": False, "db_buffer": 0, "pending": None}

    def load_state_dict(self, extra: dict[str, Any], rank: int) -> None:
        self._state.reset()
        if extra.get("pending") is not None:
            raise ValueError(
                "the checkpoint holds pending double-buffered gradients: load it into an "
                "optimizer with double_buffering=True (or call flush() before saving)"
            )
        from commopt.optim.compensation import refuse_prediction

        refuse_prediction(extra)

    def close(self) -> None:
        self._state.reset()
