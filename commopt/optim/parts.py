"""The optimizer's plan parts: which plan reduces each parameter, and one part per plan.

A *part* (:class:`Part`) is one plan's parameters, buckets and hooks (its
:class:`~commopt.optim.bucketed_params.BucketedParameters`), its schedule, its reduction
counter and the communicator its reductions run on. :class:`Parts` owns all of them and
everything that chooses them: the default plan (the wrapper's arguments), the ``plans=``
rules, the default rule of the default schedule, and ``compression="auto"`` (the first steps
measured on one exact synchronous part, then the plan's one rule per tensor). One plan is
the case of one part: the optimizer never tells the two apart.

The hooks of every part report to the part itself (:meth:`Part.grad_ready`,
:meth:`Part.backward_end`), which consults the :class:`Gate` the optimizer sets (inside
``no_sync()``, its own reads of ``param_groups``, the ``"auto"`` compute timer) and hands the
event to its schedule.

    >>> import torch, commopt
    >>> from commopt.optim.settings import Settings
    >>> model = torch.nn.Linear(3, 2)
    >>> inner = torch.optim.SGD(
    ...     [{"params": [model.weight]}, {"params": [model.bias], "double_buffering": "stale"}],
    ...     lr=0.1,
    ... )
    >>> comm = commopt.create_communicator("local")
    >>> parts = Parts(Settings.of(), comm, comm, inner, seed=0, ensure_layout=lambda: None)
    >>> parts.build(inner.param_groups, list(model.parameters()), ["weight", "bias"], model)
    >>> [part.key for part in parts]
    ['compression=None, schedule=synchronous', 'compression=None, schedule=stale']
    >>> parts.close()
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from commopt import driver
from commopt.comm.base import Communicator
from commopt.optim import schedules
from commopt.optim.auto_plan import AutoPlan, AutoPlanning, ComputeTimer, TensorInfo
from commopt.optim.bucketed_params import BucketedParameters
from commopt.optim.fingerprint import check_same_settings, wire_settings
from commopt.optim.options import resolve_codecs
from commopt.optim.plans import Plan, check_rules, group_plans, param_plans
from commopt.optim.reduction_counter import ReductionCounter, StartCallbacks
from commopt.optim.schedules import schedule_class
from commopt.optim.schedules.protocol import Schedule, ScheduleContext
from commopt.optim.settings import Settings
from commopt.optim.step_multipliers import StepMultipliers
from commopt.reducer import GradientReducer

__all__ = ["Gate", "Part", "Parts", "part_seed"]

log = logging.getLogger("commopt")


def part_seed(seed: int, index: int) -> int:
    """The random key of part ``index``'s codecs (part 0: the optimizer's seed)."""
    return (seed + index * 0x9E3779B97F4A7C15) & (2**63 - 1)


def no_sync_started_error() -> RuntimeError:
    return RuntimeError(
        "a backward inside optimizer.no_sync() after this step's reduction started "
        "(a backward outside no_sync(), or synchronize()): these gradients would "
        "miss the average. Run every micro-batch but the last inside no_sync() and "
        "the last one outside, then synchronize()/step()"
    )


class Gate:
    """What the optimizer tells every part's hooks: inside ``no_sync()`` (``accumulating``),
    inside its own code (:meth:`own_reads`: no implicit ``synchronize()`` on reading
    ``param_groups``), and the ``"auto"`` compute timer while it measures (else None)."""

    def __init__(self) -> None:
        self.accumulating = False
        self.internal = 0
        self.timer: ComputeTimer | None = None

    @contextlib.contextmanager
    def own_reads(self) -> Iterator[None]:
        self.internal += 1
        try:
            yield
        finally:
            self.internal -= 1


class Part:
    """One plan's parameters, buckets, hooks, schedule, counter and communicator."""

    def __init__(
        self,
        plan: Plan,
        index: int,
        codecs: tuple[Any, Any, Any],
        data_comm: Communicator,
        release: weakref.finalize[Any, Any] | None,
        gate: Gate,
        make_schedule: Callable[[BucketedParameters, ReductionCounter], Schedule],
        counter: ReductionCounter,
    ) -> None:
        self.plan = plan
        self.key = str(plan)
        self.index = index
        self.codec, self.plain_codec, self.policy = codecs
        self.counter = counter
        self.data_comm = data_comm
        self.release = release  # a communicator this part owns
        self.gate = gate
        self.owned = BucketedParameters(self.grad_ready, self.backward_end)
        self.schedule = make_schedule(self.owned, counter)

    # -- the hooks' events ----------------------------------------------------------------
    def grad_ready(self, index: int) -> None:
        """Backward produced gradient ``index`` of this part."""
        gate = self.gate
        if gate.accumulating:
            if self.schedule.started:
                # This step's reduction has started (or finished): these gradients would be
                # added, un-averaged, to what it sends or has already averaged.
                raise no_sync_started_error()
            return
        if gate.timer is not None:
            gate.timer.grad_ready()
        # Once per backward: DDP's contract, the averages are in .grad when backward() returns.
        self.owned.hooks.queue_end_of_backward()
        self.schedule.grad_ready(index)

    def backward_end(self) -> None:
        """End of a backward that reached this part's hooks (autograd's final callback).

        The synchronous schedule with ``overlap=True`` finishes the reduction here, so
        ``param.grad`` holds the averages when ``backward()`` returns, as under DDP.
        """
        gate = self.gate
        if gate.accumulating:
            return
        if gate.timer is not None:
            gate.timer.backward_end()
        with gate.own_reads():
            self.schedule.backward_end()

    def close(self) -> None:
        """Close the schedule, detach the hooks, queue this part's communicator's release."""
        self.schedule.close()
        self.owned.remove_hooks()
        if self.release is not None:
            self.release()


class Parts:
    """Every plan part of one optimizer, and the choice of plans (see the module)."""

    def __init__(
        self,
        settings: Settings,
        comm: Communicator,
        data_comm: Communicator,
        inner: torch.optim.Optimizer,
        *,
        seed: int,
        ensure_layout: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.comm = comm
        self.data_comm = data_comm
        self.inner = inner
        self.seed = seed
        self.ensure_layout = ensure_layout
        self.gate = Gate()
        self.start_callbacks = StartCallbacks()  # commopt.Join's, once a step
        self.parts: list[Part] = []
        self._made = 0
        self._rule_logged = False
        #: the schedule the wrapper's arguments choose (the default plan's, "auto" decided)
        self.final_schedule = settings.default_schedule
        compression = settings.compression
        self.auto: AutoPlanning | None = None
        if isinstance(compression, str) and compression.strip().lower() == "auto":
            _refuse_auto_with_plans(inner.param_groups, settings.plans)
            local = _local_steps(settings, self.final_schedule)
            self.auto = AutoPlanning(  # (the rate: later)
                0.0,
                settings.auto_measure_steps,
                schedule=self.final_schedule,
                local_steps=local[0] if local else None,
                local_fragments=local[1] if local else 1,
                local_overlap=local[2] if local else 0,
            )
            self.gate.timer = self.auto.timer
            compression = None
        self.codecs = resolve_codecs(
            comm, settings.allreduce_grad_dtype, compression, settings.policy
        )
        if self.auto is None:
            self.default = Plan(compression, self.final_schedule)
            self.rules = check_rules(settings.plans)
        else:
            # The measured steps: inner steps of the local-steps candidate's cycle, which send
            # nothing (its clock waits where the cycle would send; a plan of local steps takes
            # the cycle up, another one starts from the weights every rank agrees on); else
            # exact, synchronous, in step().
            self.default = Plan(None, _measuring_schedule(self.auto))
            self.rules = []

    def __iter__(self) -> Iterator[Part]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    @property
    def first(self) -> Part:
        return self.parts[0]

    def by_key(self, key: str) -> Part:
        for part in self.parts:
            if part.key == key:
                return part
        raise KeyError(f"no plan {key!r}; the plans are {[p.key for p in self.parts]}")

    def data_comms(self) -> list[Communicator]:
        """The communicators this optimizer's reductions run on (each once)."""
        return list(dict.fromkeys([self.data_comm, *(p.data_comm for p in self.parts)]))

    # -- which plan reduces each parameter ----------------------------------------------------
    def default_rule(
        self, model: torch.nn.Module | None, params: Sequence[torch.Tensor]
    ) -> set[int]:
        """The parameters the wrapper's schedule leaves synchronous by default (its rule)."""
        cls = schedule_class(self.final_schedule)
        chosen: set[int] = cls.synchronous_by_default(self.settings.options_for(cls), model, params)
        return chosen

    def build(
        self,
        groups: Sequence[dict[str, Any]],
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        model: torch.nn.Module | None,
    ) -> None:
        """(Re)build the parts for ``params`` (``names``: theirs, ``groups``: the inner
        optimizer's ``param_groups``): plans, parts, buckets, hooks. Every rank's plans and
        wire settings are compared first (a collective call)."""
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        synchronous = self.default_rule(model, params)
        plans = param_plans(groups, names, self.default, self.rules, synchronous)
        self._log_default_rule(
            [
                n
                for n, p, plan in zip(names, params, plans)
                if id(p) in synchronous and plan.schedule == "synchronous"
            ]
        )
        described = group_plans(groups, plans)
        if self.auto is not None:
            described["compression='auto'"] = self.auto.describe()
        # Before any plan's communicator: every rank's plans and settings agree, or all raise.
        check_same_settings(self.comm, wire_settings(self.settings, self.codecs, None, described))
        order = list(dict.fromkeys(plans[i] for i in trainable)) or [self.default]
        self._set_parts(order)
        reducers = []
        for part in self.parts:
            part.owned.remove_hooks()
            mine = [i for i in trainable if plans[i] == part.plan]
            reducers.append(
                GradientReducer(
                    part.data_comm,
                    [params[i] for i in mine],
                    [names[i] for i in mine],
                    codec=part.codec,
                    plain_codec=part.plain_codec,
                    policy=part.policy,
                    bucket_cap_mb=float(self.settings.bucket_cap_mb),
                    algorithm=self.settings.algorithm,
                    num_buffers=part.schedule.num_buffers,
                    seed=part_seed(self.seed, part.index),
                    grad_views=True,
                )
            )
        buckets = [b for r in reducers for b in r.buckets]
        check_same_settings(
            self.comm, wire_settings(self.settings, self.codecs, buckets, described)
        )
        for part, reducer in zip(self.parts, reducers):
            part.owned.install(reducer, params)

    def _log_default_rule(self, names: list[str]) -> None:
        if names and not self._rule_logged:
            self._rule_logged = True
            if self.comm.rank == 0:
                shown = ", ".join(names[:8]) + (
                    f" and {len(names) - 8} more" if len(names) > 8 else ""
                )
                log.info(
                    "commopt: the %s schedule's default rule reduces %d parameter(s) "
                    "synchronously (with overlap), the embedding tables and 1-D tensors: %s; pass "
                    "synchronous_embeddings=False or synchronous_vectors=False, or a plans= "
                    "rule, to change it",
                    self.final_schedule,
                    len(names),
                    shown,
                )

    def _set_parts(self, order: list[Plan]) -> None:
        """Keep the parts of the plans in ``order`` (in that order), make the missing ones."""
        predicting = [p for p in order if schedule_class(p.schedule).predicts_weights]
        if len(predicting) > 1:
            kinds = " or ".join(sorted({p.schedule for p in predicting}))
            raise ValueError(
                f"more than one {kinds} plan ("
                + "; ".join(str(p) for p in predicting)
                + "): the prediction covers the whole inner optimizer; give every such group "
                "the same compression, or choose double_buffering='stale' for some of them"
            )
        existing = {part.plan: part for part in self.parts}
        for part in self.parts:
            if part.plan not in order:  # (drained by the caller) its parameters left
                part.close()
        driver.release_queued()
        self.parts = [existing.get(plan) or self._new_part(plan) for plan in order]

    def _new_part(self, plan: Plan) -> Part:
        index = self._made
        self._made += 1
        if plan == self.default:
            codecs = self.codecs
        else:
            codecs = resolve_codecs(
                self.comm,
                self.settings.allreduce_grad_dtype,
                plan.compression,
                self.settings.policy,
            )
        release = None
        if index == 0 or self.data_comm is self.comm:
            data_comm = self.data_comm
        else:  # each plan's reductions on a communicator of their own: no order between plans
            data_comm = self.comm.split(0, self.comm.rank)
            release = weakref.finalize(self, driver.release_when_idle, data_comm)
            release.atexit = False
        counter = ReductionCounter()
        counter.on_start(self.start_callbacks.starting)
        cls = schedule_class(plan.schedule)
        options = self.settings.options_for(cls)
        defer = self.auto is not None and self.auto.measuring

        def make_schedule(owned: BucketedParameters, counter: ReductionCounter) -> Schedule:
            context = ScheduleContext(
                owned,
                counter,
                self.inner,
                zero_fill=bool(self.settings.zero_fill),
                ensure_layout=self.ensure_layout,
                all_params=self.all_params,
                defer_to_step=defer,
            )
            schedule: Schedule = cls(context, options)
            return schedule

        return Part(plan, index, codecs, data_comm, release, self.gate, make_schedule, counter)

    def all_params(self) -> list[torch.Tensor]:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def close(self) -> None:
        """Close every part (the caller drained their reductions)."""
        for part in self.parts:
            part.close()
        driver.release_queued()

    def drop(self) -> None:
        """Close every part and forget them (``"auto"``'s measuring part, before the plan).

        The next parts are numbered from 0 again: the plan's first part reduces on the
        wrapper's own communicator with the optimizer's codec key, as the same plan given
        directly does (the same stochastic rounding, the same run)."""
        self.close()
        self.parts = []
        self._made = 0

    # -- compression="auto" ---------------------------------------------------------------------
    def auto_tensors(self, model: torch.nn.Module | None) -> list[TensorInfo]:
        """The trainable parameters as the planner sees them."""
        from commopt.codecs import CompressionPolicy
        from commopt.optim.replicas import param_names

        groups = self.inner.param_groups
        params = self.all_params()
        names = param_names(groups, model)
        policy = self.settings.policy if self.settings.policy is not None else CompressionPolicy()
        final = param_plans(
            groups, names, Plan(None, self.final_schedule), [], self.default_rule(model, params)
        )
        tensors = []
        for n, p, plan in zip(names, params, final):
            if not p.requires_grad:
                continue
            cls = schedule_class(plan.schedule)
            tensors.append(
                TensorInfo(
                    n,
                    tuple(p.shape),
                    compressible=policy.should_compress(n, p.shape),
                    double_buffered=cls.overlaps_step,
                    tie=plan.schedule if cls.predicts_weights else None,
                )
            )
        return tensors

    def use_auto_plan(self, plan: AutoPlan, model: torch.nn.Module | None) -> None:
        """Reduce every tensor as ``plan`` says, from the next step on (new parts; the caller
        drained the old ones and rebuilds)."""
        assert self.auto is not None
        tensors = self.auto_tensors(model)
        mine = {t.name for t in tensors}
        if set(plan.choices) != mine:
            raise ValueError(
                "the automatic plan names other tensors than this optimizer's trainable "
                f"parameters (plan only: {sorted(set(plan.choices) - mine)[:5]}; parameters "
                f"only: {sorted(mine - set(plan.choices))[:5]}): load a checkpoint of the "
                "same model"
            )
        self.drop()  # the measuring part is idle between steps
        self.auto.plan = plan
        self.gate.timer = None
        schedule = plan.schedule or self.final_schedule
        codec = _one_codec(plan, tensors) if schedule == "local_steps" else None
        if codec is not None:
            # One codec on exactly the tensors the policy compresses: the plan is the
            # wrapper's own compression= with that codec, one local-steps part (one per codec
            # would synchronise each fragment twice and step twice the parts)
            self.rules = []
            self.default = Plan(None if codec == "none" else codec, schedule)
            self.codecs = resolve_codecs(
                self.comm,
                self.settings.allreduce_grad_dtype,
                self.default.compression,
                self.settings.policy,
            )
            return
        self.rules = check_rules(plan.rules())
        self.default = Plan(None, schedule)


def _one_codec(plan: AutoPlan, tensors: Sequence[TensorInfo]) -> str | None:
    """The option ``plan`` gives every tensor the compression policy compresses, where it
    gives one option to all of those and none to the rest (else None)."""
    options = {plan.choices[t.name] for t in tensors if t.compressible}
    if len(options) != 1 or any(
        plan.choices[t.name] != "none" for t in tensors if not t.compressible
    ):
        return None
    return options.pop()


def _local_steps(settings: Settings, schedule: str) -> tuple[int, int, int] | None:
    """The steps between averages (``sync_every``), the fragments and the overlap of a
    schedule registered as ``local_steps``, which ``compression="auto"`` prices beside the
    per-step plans when the wrapper's own schedule is the synchronous one (a schedule given
    is kept); None without one, or when its options hold no ``sync_every``."""
    if schedule != "synchronous" or "local_steps" not in schedules.SCHEDULES:
        return None
    options = settings.options_for(schedules.schedule_class("local_steps"))

    def whole(name: str, default: int, low: int) -> int | None:
        value = getattr(options, name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return None
        return value

    every, fragments, overlap = (
        whole("sync_every", 0, 1),
        whole("fragments", 1, 1),
        whole("overlap_steps", 0, 0),
    )
    if every is None:
        return None
    return every, fragments or 1, overlap or 0


def _measuring_schedule(auto: AutoPlanning) -> str:
    """The schedule of ``compression="auto"``'s measured steps: the local-steps candidate's
    where the step multipliers price it (its measured steps send nothing: where the cycle
    would send, its clock waits for the plan), else the synchronous one."""
    if auto.local_steps is None or StepMultipliers.load().local_steps(auto.local_steps) is None:
        return "synchronous"
    return "local_steps"


def _refuse_auto_with_plans(param_groups: list[dict[str, Any]], plans: Any) -> None:
    """``compression="auto"`` chooses every tensor's codec: no rule or group may choose one."""
    if plans:
        raise ValueError(
            "compression='auto' chooses a codec for every tensor and cannot be combined with "
            "plans=; pass one or the other"
        )
    for i, group in enumerate(param_groups):
        if "compression" in group:
            raise ValueError(
                f"parameter group {i} sets compression, but compression='auto' chooses every "
                "tensor's codec: remove the group's key, or pass a codec instead of 'auto'"
            )
