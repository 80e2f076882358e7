"""The double-buffered schedules: each step sends its gradients and applies the previous step's.

:class:`DoubleBufferedSchedule` owns the reduction in flight between steps (a
:class:`~commopt.optim.double_buffering.DoubleBuffer`): each step's exchange sends this
step's gradients and hands back the previous step's averages (one step stale), which the
step applies; :meth:`~DoubleBufferedSchedule.flush` applies the last pending reduction.
:class:`CompensatedSchedule` (``"compensated"``, what ``double_buffering=True`` means) also
holds a :class:`~commopt.optim.compensation.Compensation`: the model moves to the predicted
weights after each step and back to the true ones before an average is applied; as the
wrapper's default it leaves the embedding tables and 1-D tensors to the synchronous schedule
(:mod:`~commopt.optim.default_rule`). :class:`DoubleBufferedSchedule` (``"stale"``) is
ChainerMN's plain double buffering: the stale average is applied at the current weights. GradScaler drives these steps through its scale (each rank unscales
its own gradients before sending them).

    >>> import torch, commopt
    >>> from commopt.optim.bucketed_params import BucketedParameters
    >>> from commopt.optim.reduction_counter import ReductionCounter
    >>> from commopt.optim.schedules.protocol import ScheduleContext
    >>> from commopt.reducer import GradientReducer
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> comm = commopt.create_communicator("local")
    >>> owned = BucketedParameters(lambda i: None, lambda: schedule.backward_end())
    >>> owned.install(GradientReducer(comm, [w], ["w"], num_buffers=2), [w])
    >>> context = ScheduleContext(
    ...     owned, ReductionCounter(), torch.optim.SGD([w], lr=0.1), zero_fill=True,
    ...     ensure_layout=lambda: None, all_params=lambda: [w],
    ... )
    >>> schedule = DoubleBufferedSchedule(context)
    >>> (w * 3).sum().backward()
    >>> schedule.result(skip_synchronize=False) is None  # sent; nothing to apply yet
    True
    >>> schedule.flush().nonfinite, w.grad.tolist()
    (False, [3.0, 3.0])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from commopt.optim.apply_step import inverse_grad_scale
from commopt.optim.compensation import (
    Compensation,
    LocalGradients,
    refuse_prediction,
    unpack_replaces_grad,
)
from commopt.optim.default_rule import default_synchronous
from commopt.optim.double_buffering import DoubleBuffer
from commopt.optim.schedules.protocol import (
    ScheduleBase,
    ScheduleContext,
    not_synchronized_error,
)
from commopt.reducer import StepReduction, StepResult

__all__ = ["CompensatedOptions", "CompensatedSchedule", "DoubleBufferedSchedule"]


class DoubleBufferedSchedule(ScheduleBase):
    """Step t's averages are applied at step t+1, at the current weights (``"stale"``)."""

    name = "stale"
    num_buffers = 2
    overlaps_step = True
    refused_under = "double_buffering=True"
    supports_closures = False
    closure_refusal = "double buffering (gradients applied one step late)"
    closure_fix = "double_buffering=False"
    #: GradScaler hands over its scale: each rank unscales its own gradients as it sends them.
    unscales_locally = True
    checkpoint_keys: ClassVar[tuple[str, ...]] = ("db_buffer", "pending")

    def __init__(self, context: ScheduleContext, options: Any = None) -> None:
        super().__init__(context, options)
        self._ensure_layout = context.ensure_layout
        self._all_params = context.all_params
        self.compensation: Compensation | None = None
        self._db = DoubleBuffer()

    # -- inspection ---------------------------------------------------------------------------
    @property
    def pending(self) -> StepReduction | None:
        """The reduction in flight between steps (applied by the next step), else None."""
        return self._db.pending

    def zero_grad_buffer(self) -> int | None:
        """The buffer set the next backward fills (``zero_grad(set_to_none=False)``)."""
        self.guard.clear()
        return self._db.buffer

    # -- events (nothing is sent during backward: the exchange sends the whole step) ---------
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
        state = self._db.state_dict()
        if self.compensation is not None:
            state.update(self.compensation.state())
        return state

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        self._db.load_state_dict(state, self.bucketed.reducer)
        if self.compensation is None:
            refuse_prediction(state)
        else:
            self.compensation.load(state, rank)

    def close(self) -> None:
        self._db.drop()
        if self.compensation is not None:
            self.compensation.restore()


@dataclass(frozen=True)
class CompensatedOptions:
    """The default rule's parts (as the wrapper's default schedule): ``synchronous_embeddings``,
    the embedding tables and the parameters tied to them, and ``synchronous_vectors``, the 1-D
    tensors, reduce synchronously unless a group or a ``plans=`` rule chooses."""

    synchronous_embeddings: bool = True
    synchronous_vectors: bool = True


class CompensatedSchedule(DoubleBufferedSchedule):
    """Double buffering whose stale averages are applied at weights predicted from each rank's
    local gradient (``"compensated"``, what ``double_buffering=True`` means; SGD, Adam, AdamW
    and LARS: a TypeError names ``double_buffering="stale"`` for an update rule it cannot
    predict)."""

    name = "compensated"
    options = CompensatedOptions
    predicts_weights = True
    checkpoint_keys = ("db_buffer", "pending", "compensated", "predicted")
    own_keys = ("predicted",)

    def __init__(self, context: ScheduleContext, options: CompensatedOptions | None = None):
        super().__init__(context, options)
        self.compensation = Compensation(context.inner)

    @classmethod
    def synchronous_by_default(
        cls,
        options: CompensatedOptions,
        model: torch.nn.Module | None,
        params: Sequence[torch.Tensor],
    ) -> set[int]:
        return default_synchronous(
            model,
            params,
            embeddings=options.synchronous_embeddings,
            vectors=options.synchronous_vectors,
        )
