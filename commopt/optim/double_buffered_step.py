"""The double-buffered schedule: each step sends its gradients and applies the previous step's.

:class:`DoubleBufferedSchedule` owns the reduction in flight between steps (a
:class:`~commopt.optim.double_buffering.DoubleBuffer`): each step's exchange sends this
step's gradients and hands back the previous step's averages (one step stale), which the
step applies; :meth:`~DoubleBufferedSchedule.flush` applies the last pending reduction.
With ``"compensated"`` it also holds a :class:`~commopt.optim.compensation.Compensation`:
the model moves to the predicted weights after each step and back to the true ones before
an average is applied. GradScaler drives these steps through its scale (each rank unscales
its own gradients before sending them).

    >>> import torch, commopt
    >>> from commopt.optim.bucketed_params import BucketedParameters
    >>> from commopt.optim.reduction_counter import ReductionCounter
    >>> from commopt.reducer import GradientReducer
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> comm = commopt.create_communicator("local")
    >>> schedule = DoubleBufferedSchedule(
    ...     ReductionCounter(), zero_fill=True, ensure_layout=lambda: None, all_params=lambda: [w]
    ... )
    >>> owned = BucketedParameters(schedule.grad_ready, schedule.backward_end)
    >>> owned.install(GradientReducer(comm, [w], ["w"], num_buffers=2), [w])
    >>> schedule.attach(owned)
    >>> (w * 3).sum().backward()
    >>> schedule.result(skip_synchronize=False) is None  # sent; nothing to apply yet
    True
    >>> schedule.flush().nonfinite, w.grad.tolist()
    (False, [3.0, 3.0])
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from commopt.optim.compensation import (
    COMPENSATED,
    Compensation,
    LocalGradients,
    unpack_replaces_grad,
)
from commopt.optim.double_buffering import DoubleBuffer
from commopt.optim.reduction_counter import ReductionCounter
from commopt.optim.schedule_base import ScheduleBase
from commopt.optim.synchronous_step import not_synchronized_error
from commopt.reducer import StepResult

__all__ = ["DoubleBufferedSchedule", "inverse_grad_scale"]


def inverse_grad_scale(grad_scale: Any) -> float | torch.Tensor:
    """1 / GradScaler's scale when GradScaler drives this step (``grad_scale`` None: 1).

    GradScaler's scale is a tensor on the gradients' device: its inverse stays there (a
    0-dim float64 tensor the reduction multiplies by on the device; never read on the host).
    """
    if grad_scale is None:
        return 1.0
    if isinstance(grad_scale, torch.Tensor):
        return torch.reciprocal(grad_scale.detach().to(torch.float64))
    return 1.0 / float(grad_scale)


class DoubleBufferedSchedule(ScheduleBase):
    """Step t's averages are applied at step t+1 (``double_buffering=True``/``"compensated"``).

    ``compensation``: the prediction of ``double_buffering="compensated"`` (None: plain).
    """

    double_buffered = True
    refused_under = "double_buffering=True"
    supports_closures = False
    #: GradScaler hands over its scale: each rank unscales its own gradients as it sends them.
    unscales_locally = True

    def __init__(
        self,
        counter: ReductionCounter,
        *,
        zero_fill: bool,
        ensure_layout: Callable[[], None],
        all_params: Callable[[], Sequence[torch.Tensor]],
        compensation: Compensation | None = None,
    ) -> None:
        self.counter = counter
        self.zero_fill = bool(zero_fill)
        self._ensure_layout = ensure_layout
        self._all_params = all_params
        self.compensation = compensation
        #: the ``double_buffering=`` value this schedule implements
        self.mode: bool | str = True if compensation is None else COMPENSATED
        super().__init__()
        self._db = DoubleBuffer()

    # -- inspection ---------------------------------------------------------------------------
    @property
    def pending(self):
        """The reduction in flight between steps (applied by the next step), else None."""
        return self._db.pending

    @property
    def started(self) -> bool:
        """Whether this step's gradients were sent (``no_sync()`` backwards then miss them)."""
        return False  # (sent as a whole by step() or synchronize(), never during backward)

    @property
    def reads_synchronize(self) -> bool:
        return False  # param.grad holds what step() applies only after the exchange

    def zero_grad_buffer(self) -> int | None:
        """The buffer set the next backward fills (``zero_grad(set_to_none=False)``)."""
        self.guard.clear()
        return self._db.buffer

    def applied_params(self) -> list[torch.Tensor]:
        """The parameters whose (stale) averages the step applies (clipped together)."""
        return self.bucketed.params

    # -- events -------------------------------------------------------------------------------
    def grad_ready(self, index: int) -> None:
        """Nothing is sent during backward: the exchange sends the whole step at once."""

    def backward_end(self) -> None:
        """Remember the gradients' versions: ``step()`` tells a write (a clip) before sending."""
        self.guard.record(self.bucketed.params)

    def _exchange(self, scale: float | torch.Tensor) -> None:
        """Send this step's gradients; put the previous step's averages into ``param.grad``."""
        owned = self.bucketed
        reducer = owned.reducer
        if self.compensation is not None:
            self.compensation.local = LocalGradients.take(
                self._all_params(), reducer.params, scale, unpack_replaces_grad(reducer)
            )
        self._db.exchange(
            lambda buffer: self.counter.start(reducer, scale=scale, buffer=buffer),
            reducer,
            self.zero_fill,
        )

    def synchronize(self, explicit: bool = True) -> None:
        """Send this step's gradients now (once a step): the previous step's averages land in
        ``param.grad``, where ``step()`` applies them."""
        if explicit:
            self.guard.clear()
        if not self._db.exchanged:
            self._ensure_layout()
            self._exchange(scale=1.0)

    def result(
        self, *, skip_synchronize: bool, scale: Any = None, found_inf: Any = None
    ) -> StepResult | None:
        """Send this step's gradients (unless ``synchronize()`` did); the previous step's result.

        ``scale``: GradScaler's scale when it drives this step; ``found_inf``: its flag (set
        when ``unscale_`` ran, which writes the gradients: allowed).
        """
        if not self._db.exchanged:
            if skip_synchronize:
                raise not_synchronized_error()
            if not (found_inf is not None and scale is None):
                self._check_no_local_writes()
            self.guard.clear()
            self._ensure_layout()
            self._exchange(inverse_grad_scale(scale))
        elif scale is not None and float(scale) != 1.0:  # (a host read only on this error path)
            raise RuntimeError(
                "with double_buffering and GradScaler, call scaler.unscale_(optimizer) before "
                "optimizer.synchronize(): the gradients were sent still scaled"
            )
        if self.compensation is not None:
            self.compensation.restore()  # the stale average is applied at the true weights
        return self._db.take()

    def after_step(self, result: StepResult | None, max_norm: float | None) -> None:
        """Compensated: move the model to the weights this step's local gradients predict."""
        if self.compensation is None:
            return
        pending = self._db.pending  # this step's reduction: its local NaN/Inf flag
        local_bad = False if pending is None else pending.local_nonfinite()
        self.compensation.predict(local_bad, max_norm)

    def discard(self) -> None:
        self.guard.clear()

    def flush(self) -> StepResult | None:
        """The last pending averages, unpacked (None: nothing pending); true weights after."""
        comp = self.compensation
        if self._db.pending is None:
            if comp is not None:
                comp.restore()
            return None
        if comp is not None:
            comp.local = None
            comp.restore()  # the model keeps the true weights from here on
        return self._db.flush(self.zero_fill)

    def before_layout_change(self) -> None:
        """Put the true weights back (broadcasts and new groups see them, not predicted ones)."""
        if self.compensation is not None:
            self.compensation.restore()

    @contextlib.contextmanager
    def true_weights(self) -> Iterator[None]:
        if self.compensation is None:
            yield
            return
        with self.compensation.true_weights():
            yield

    # -- checkpoint, close --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``db_buffer`` and ``pending`` (completed first); compensated: the prediction too."""
        db = self._db.state_dict()
        state = {"double_buffering": True, "db_buffer": db["db_buffer"], "pending": db["pending"]}
        if self.compensation is not None:
            state.update(self.compensation.state())
        return state

    def load_state_dict(self, extra: dict[str, Any], rank: int) -> None:
        self._db.load_state_dict(extra, self.bucketed.reducer)
        if self.compensation is None:
            from commopt.optim.compensation import refuse_prediction

            refuse_prediction(extra)
        else:
            self.compensation.load(extra, rank)

    def close(self) -> None:
        self._db.drop()
        if self.compensation is not None:
            self.compensation.restore()
