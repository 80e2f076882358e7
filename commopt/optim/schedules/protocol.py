"""The schedule protocol: everything the optimizer says to a schedule, and all it asks of one.

A *schedule* decides when a step's gradients are sent and which step applies their averages.
The optimizer (:mod:`commopt.optim.multi_node`) makes one schedule per plan part and talks to
it only through :class:`Schedule`: the events of a training step, in the order they come,
and what a schedule declares about itself.

Events (each a method; the optimizer calls them in this order within a step):

- ``grad_ready(index)``: backward produced gradient ``index`` of the part (outside
  ``no_sync()``); ``backward_end()``: the backward that reached the part's hooks ended;
- ``synchronize()``: the user (or a read of ``param_groups``) asks for the averages now;
- ``result(...)``: ``step()`` asks for the averages to apply (a
  :class:`~commopt.reducer.StepResult`, or None: nothing to apply this step);
- ``after_step(result, max_norm)``: the inner step ran (or was skipped on every rank);
- ``discard()``: a ``step(closure)`` evaluation's gradients were consumed; ``flush()``: apply
  what is pending (None: nothing); ``final_sync()``: at the end of training, before
  ``flush()``, bring every rank to the agreed weights (a no-op where every step does);
  ``before_layout_change()``: the buckets are rebuilt;
- ``state_dict()`` / ``load_state_dict(state, rank)``: the schedule's part of the
  checkpoint; ``close()``: the optimizer is closed or the part is dropped;
- ``cycle_state()`` / ``continue_cycle(state)``: a part replaced by parts of another plan
  (``compression="auto"``'s measuring part, by the plan's) tells where its cycle stands
  (None: nothing to continue), and a new part takes it up (False: it cannot; the optimizer
  then brings every rank to the agreed weights first, with ``final_sync()``).

Declarations (class attributes): ``name`` (the registry's), ``options`` (a frozen dataclass
of the schedule's own keyword arguments of ``create_multi_node_optimizer``, with defaults),
``num_buffers`` (bucket buffer sets), ``predicts_weights`` (the model holds predicted
weights between steps: ``true_weights()`` matters, and at most one part may predict),
``overlaps_step`` (a reduction overlaps a whole step, not only the backward: what the
``"auto"`` planner budgets), ``supports_closures`` (and, where False, ``closure_refusal``:
what the schedule does that ``step(closure)`` cannot live with, and ``closure_fix``: the
setting that gives a schedule that can), ``reduces_every_step`` (every
``step()`` starts a reduction on every rank: what ``commopt.Join`` counts on to shadow the
others' steps), ``unscales_locally`` (GradScaler hands
its scale over and each rank unscales as it sends), ``checkpoint_keys`` and
``own_keys`` (those of its keys that are this rank's own, saved in the rank's part).

:class:`ScheduleBase` holds what every schedule does the same way (the parameters it
reduces, the ``.grad`` write guard, the no-op events); a new schedule derives from it and
overrides the events it acts on. See CONTRIBUTING.md, "How to add a schedule".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from commopt.optim import clipping
from commopt.optim.bucketed_params import BucketedParameters
from commopt.optim.reduction_counter import ReductionCounter
from commopt.reducer import StepResult

__all__ = [
    "NoOptions",
    "Schedule",
    "ScheduleBase",
    "ScheduleContext",
    "not_synchronized_error",
]


@dataclass(frozen=True)
class NoOptions:
    """The options of a schedule that has none."""


@dataclass(frozen=True)
class ScheduleContext:
    """What the optimizer hands a schedule when it makes it.

    ``bucketed``: the part's parameters, buckets and hooks; ``counter``: its reduction
    counter; ``inner``: the wrapped optimizer; ``zero_fill``: the wrapper's setting;
    ``ensure_layout()``: rebuild the buckets if the parameters changed (before sending);
    ``all_params()``: every parameter of the inner optimizer, in ``param_groups`` order;
    ``defer_to_step``: ``compression="auto"``'s measuring part: send nothing during backward
    (the backward pass is measured alone), and a schedule that sends on some steps only
    (local steps) sends nothing at all.
    """

    bucketed: BucketedParameters
    counter: ReductionCounter
    inner: torch.optim.Optimizer
    zero_fill: bool
    ensure_layout: Callable[[], None]
    all_params: Callable[[], Sequence[torch.Tensor]]
    defer_to_step: bool = False


class Schedule(Protocol):
    """What the optimizer calls on a schedule (see the module's docstring)."""

    name: ClassVar[str]
    options: ClassVar[type]
    num_buffers: ClassVar[int]
    predicts_weights: ClassVar[bool]
    overlaps_step: ClassVar[bool]
    supports_closures: ClassVar[bool]
    closure_refusal: ClassVar[str]
    closure_fix: ClassVar[str]
    reduces_every_step: ClassVar[bool]
    unscales_locally: ClassVar[bool]
    checkpoint_keys: ClassVar[tuple[str, ...]]
    own_keys: ClassVar[tuple[str, ...]]

    @classmethod
    def synchronous_by_default(
        cls, options: Any, model: torch.nn.Module | None, params: Sequence[torch.Tensor]
    ) -> set[int]:
        """The ids of the parameters this schedule, as the wrapper's default, leaves to the
        synchronous schedule unless a group or a rule chooses (the default rule)."""
        ...

    @property
    def started(self) -> bool:
        """Whether this step's reduction started (a ``no_sync()`` backward would miss it)."""
        ...

    @property
    def reads_synchronize(self) -> bool:
        """Whether a read of ``param_groups`` now should ``synchronize()`` first."""
        ...

    def zero_grad_buffer(self) -> int | None:
        """The buffer set ``zero_grad(set_to_none=False)`` may point ``.grad`` at (None: none)."""
        ...

    def applied_params(self) -> list[torch.Tensor]:
        """The parameters whose averages the step applies (clipped together)."""
        ...

    def grad_ready(self, index: int) -> None: ...

    def backward_end(self) -> None: ...

    def synchronize(self, explicit: bool = True) -> None: ...

    def result(
        self, *, skip_synchronize: bool, scale: Any = None, found_inf: Any = None
    ) -> StepResult | None: ...

    def after_step(self, result: StepResult | None, max_norm: float | None) -> None: ...

    def discard(self) -> None: ...

    def flush(self) -> StepResult | None: ...

    def final_sync(self) -> None: ...

    def before_layout_change(self) -> None: ...

    def true_weights(self) -> contextlib.AbstractContextManager[None]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None: ...

    def close(self) -> None: ...

    def cycle_state(self) -> dict[str, Any] | None:
        """Where this part's cycle stands, for a part that replaces it (None: nothing)."""
        ...

    def continue_cycle(self, state: dict[str, Any]) -> bool:
        """Take up the cycle a replaced part left (False: this schedule cannot)."""
        ...


def not_synchronized_error() -> RuntimeError:
    """``step()`` inside ``skip_synchronize()`` before this step's gradients were averaged."""
    return RuntimeError(
        "step() inside optimizer.skip_synchronize() but the gradients of this step were not "
        "averaged yet: call optimizer.synchronize() after backward() and before step()"
    )


class ScheduleBase:
    """What every schedule holds the same way: its context, the ``.grad`` write guard, and
    the events most schedules ignore (see :class:`Schedule` for each)."""

    name: ClassVar[str] = ""
    options: ClassVar[type] = NoOptions
    num_buffers: ClassVar[int] = 1
    predicts_weights: ClassVar[bool] = False
    overlaps_step: ClassVar[bool] = False
    supports_closures: ClassVar[bool] = True
    closure_refusal: ClassVar[str] = "this schedule"
    closure_fix: ClassVar[str] = 'schedule="synchronous"'
    reduces_every_step: ClassVar[bool] = True
    unscales_locally: ClassVar[bool] = False
    checkpoint_keys: ClassVar[tuple[str, ...]] = ()
    own_keys: ClassVar[tuple[str, ...]] = ()
    #: the setting named when a write to ``.grad`` before the reduction is refused
    refused_under: ClassVar[str] = ""

    def __init__(self, context: ScheduleContext, options: Any = None) -> None:
        self.context = context
        self.settings = self.options() if options is None else options
        self.counter = context.counter
        self.zero_fill = bool(context.zero_fill)
        self.guard = clipping.GradWriteGuard()  # .grad writes before the reduction

    @classmethod
    def synchronous_by_default(
        cls, options: Any, model: torch.nn.Module | None, params: Sequence[torch.Tensor]
    ) -> set[int]:
        return set()

    @property
    def bucketed(self) -> BucketedParameters:
        """The parameters, buckets and hooks this schedule reduces."""
        return self.context.bucketed

    @property
    def double_buffered(self) -> bool:
        """Whether a reduction stays in flight between steps (two buffer sets; inspection)."""
        return self.num_buffers > 1

    @property
    def started(self) -> bool:
        return False

    @property
    def reads_synchronize(self) -> bool:
        return False

    def zero_grad_buffer(self) -> int | None:
        self.guard.clear()
        return 0

    def applied_params(self) -> list[torch.Tensor]:
        return self.bucketed.params

    def grad_ready(self, index: int) -> None:
        """Nothing is sent during backward (unless the schedule says otherwise)."""

    def backward_end(self) -> None:
        """Remember the gradients' versions: ``step()`` tells a write (a clip) before sending."""
        self.guard.record(self.bucketed.params)

    def after_step(self, result: StepResult | None, max_norm: float | None) -> None:
        """Nothing to do after the inner step."""

    def discard(self) -> None:
        self.guard.clear()

    def flush(self) -> StepResult | None:
        return None  # nothing pending

    def final_sync(self) -> None:
        """Nothing: every step's averages leave the ranks with the same weights."""

    def before_layout_change(self) -> None:
        """Nothing of the old buckets to forget."""

    @contextlib.contextmanager
    def true_weights(self) -> Iterator[None]:
        yield  # the model always holds the true weights

    def close(self) -> None:
        """Nothing to release."""

    def cycle_state(self) -> dict[str, Any] | None:
        return None  # every step leaves the ranks agreeing: nothing to continue

    def continue_cycle(self, state: dict[str, Any]) -> bool:
        return False

    def _check_no_local_writes(self) -> None:
        """Refuse a write to ``.grad`` between the end of backward and the reduction."""
        owned = self.bucketed
        written = self.guard.written(owned.params, owned.reducer.names)
        self.guard.clear()
        if written:
            raise clipping.write_before_reduction_error(written, self.refused_under)


def option_names(classes: Collection[Any]) -> dict[str, Any]:
    """Each option name declared by one of ``classes`` (schedules), and the first declarer."""
    from dataclasses import fields

    out: dict[str, Any] = {}
    for cls in classes:
        for f in fields(cls.options):
            out.setdefault(f.name, cls)
    return out
