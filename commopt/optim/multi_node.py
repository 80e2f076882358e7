"""``create_multi_node_optimizer``: data-parallel training by wrapping any torch optimizer.

:class:`MultiNodeOptimizer` is the ``torch.optim.Optimizer`` surface that torch, GradScaler,
LR schedulers and users call. It is composed of objects that each own their state:

- :class:`~commopt.optim.bucketed_params.BucketedParameters`: the trainable parameters, their
  buckets (the reducer's layout) and the backward hooks, which call back into the schedule;
- one *part* per plan (:mod:`~commopt.optim.plans`: the ``compression`` and
  ``double_buffering`` a parameter group or a ``plans=`` rule chooses; the wrapper's
  arguments are the default), each with its own buckets, hooks and schedule;
- the schedule of each part, picked once when its plan first appears: :class:`~commopt.optim.synchronous_step.SynchronousSchedule`
  (``overlap`` on or off) or :class:`~commopt.optim.double_buffered_step.DoubleBufferedSchedule`
  (holding a :class:`~commopt.optim.compensation.Compensation` when ``"compensated"``);
- :class:`~commopt.optim.apply_step.StepApplier`: the collective NaN/Inf skip, clipping and
  the step counters; :class:`~commopt.optim.reduction_counter.ReductionCounter`: the
  reductions' numbers (the codecs' random keys) and the start callbacks (``commopt.Join``);
- :mod:`~commopt.optim.closures` (``step(closure)``), :mod:`~commopt.optim.checkpoint` (the
  state dict's part, combined from the components'), :mod:`~commopt.optim.replicas`
  (same-model check, broadcast from rank 0), :mod:`~commopt.optim.options` (argument checks,
  codecs), :mod:`~commopt.optim.fingerprint` (the settings every rank must share).

The reducer (:mod:`commopt.reducer`) owns the buckets and the codecs; the collectives own the
algorithms; :mod:`commopt.driver` owns the threads.

    >>> import torch, commopt
    >>> comm = commopt.create_communicator("local")
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = commopt.create_multi_node_optimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model
    ... )
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> opt.step(); opt.zero_grad()
    >>> opt.applied_steps, opt.skipped_steps
    (1, 0)

Modes (docs/optimizer.md): ``overlap=True`` sends buckets during backward, ``overlap=False``
in ``step()``; ``double_buffering=True`` applies step t's average at step t+1 (``flush()``
applies the last one), ``"compensated"`` at the weights each rank's gradient predicts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from commopt import driver
from commopt.codecs.base import Codec
from commopt.comm.base import Communicator
from commopt.optim._wrapping import init_hook_tables, inner_attribute
from commopt.optim.apply_step import StepApplier
from commopt.optim.auto_plan import (
    AutoPlan,
    AutoPlanning,
    TensorInfo,
    link_rate_setting,
    probe_link_rate,
)
from commopt.optim.bucketed_params import BucketedParameters
from commopt.optim.checkpoint import (
    commopt_state,
    load_commopt_state,
    load_plans_state,
    plans_state,
)
from commopt.optim.closures import step_with_closure
from commopt.optim.compensation import Compensation, parse_mode
from commopt.optim.double_buffered_step import DoubleBufferedSchedule, inverse_grad_scale
from commopt.optim.fingerprint import check_same_plans, check_same_settings
from commopt.optim.options import check_arguments, refuse_ddp, resolve_codecs
from commopt.optim.plans import (
    PLAN_KEYS,
    Plan,
    check_rules,
    default_synchronous,
    group_plans,
    param_plans,
)
from commopt.optim.reduction_counter import ReductionCounter
from commopt.optim.replicas import (
    ModelMismatchError,
    broadcast_from_root,
    check_same_model,
    param_names,
)
from commopt.optim.synchronous_step import SynchronousSchedule
from commopt.reducer import GradientReducer, StepResult

__all__ = ["ModelMismatchError", "MultiNodeOptimizer", "create_multi_node_optimizer"]

log = logging.getLogger("commopt")


def create_multi_node_optimizer(
    optimizer: torch.optim.Optimizer,
    comm: Communicator,
    double_buffering: bool | str = False,
    zero_fill: bool = True,
    *,
    allreduce_grad_dtype=None,
    compression: Codec | str | None = None,
    overlap: bool = True,
    bucket_cap_mb: float = 25,
    policy=None,
    model: torch.nn.Module | None = None,
    seed: int | None = None,
    algorithm: str = "auto",
    clip_grad_norm: float | None = None,
    plans=None,
    synchronous_embeddings: bool = True,
    synchronous_vectors: bool = True,
    auto_link_rate: float | str | None = None,
    auto_measure_steps: int = 3,
) -> MultiNodeOptimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over ``comm``.

    ``allreduce_grad_dtype`` (torch dtype or "float16"/"bfloat16"/"float32"; default: the
    communicator's) is the wire dtype when ``compression`` is None. ``compression`` is a
    Codec or a name for ``commopt.codecs.get_codec`` ("qsgd4", "qsgd4+ef", "fp16"...),
    applied per tensor by ``policy`` (default ``CompressionPolicy()``; the others travel
    in ``allreduce_grad_dtype``). ``model`` (optional) names the parameters in errors and
    has its buffers broadcast from rank 0 with the parameters. ``seed`` keys stochastic
    rounding (default: rank 0's ``torch.initial_seed()``). ``algorithm`` is passed to
    ``commopt.collectives.allreduce``. ``clip_grad_norm`` (optional) clips the averaged
    gradients the inner step applies to this global L2 norm (the same decision on every rank;
    with double buffering, the gradients of the step being applied); the norm before clipping
    is in ``last_grad_norm``. ``double_buffering``: False, True (the average of step t is
    applied at step t+1) or ``"compensated"`` (double buffering whose stale averages are
    applied at weights predicted from each rank's local gradient; SGD, Adam, AdamW and LARS;
    between steps the model holds the predicted weights: evaluate inside
    ``with opt.true_weights():`` or after ``flush()``; docs/optimizer.md).

    Per-group plans: a parameter group of ``optimizer`` may set its own ``compression`` and
    ``double_buffering`` (the arguments above are the defaults); ``plans`` (optional), a list
    of ``(pattern, {"compression": ..., "double_buffering": ...})`` rules matched with
    ``fnmatch`` against the parameters' names in ``model``, does the same by name (the
    first matching rule wins; a group's own keys win over the rules).
    The default rule, under ``double_buffering="compensated"`` (rank 0 logs it once; a rule or
    a group's own key still wins): ``synchronous_embeddings`` (default True), ``model``'s
    ``nn.Embedding`` weights and the parameters tied to them, and ``synchronous_vectors``
    (default True), the 1-D parameters (biases, normalisation scales), reduce synchronously
    (with ``overlap``).

    ``compression="auto"``: a codec per tensor, chosen by rank 0 after the first
    ``1 + auto_measure_steps`` steps (reduced exactly, in ``step()``, while the backward pass
    and the time between steps are measured) so that the reduction fits under the backward
    pass (under the step for double-buffered tensors) on a link of ``auto_link_rate`` (bytes/s,
    or a text such as ``"1gbit"``; default: the ``COMMOPT_LINK_RATE`` environment variable,
    else a short probe of the link at construction). Rank 0 broadcasts the plan as JSON, logs
    it as a table once, and the checkpoint records it (``opt.auto_plan``; docs/optimizer.md).

    Every rank must create the wrapper, call ``step()``, ``synchronize()``,
    ``add_param_group()`` and ``flush()`` in the same order (``state_dict()`` starts no
    communication: each rank saves its own).
    """
    return MultiNodeOptimizer(
        optimizer,
        comm,
        double_buffering=double_buffering,
        zero_fill=zero_fill,
        allreduce_grad_dtype=allreduce_grad_dtype,
        compression=compression,
        overlap=overlap,
        bucket_cap_mb=bucket_cap_mb,
        policy=policy,
        model=model,
        seed=seed,
        algorithm=algorithm,
        clip_grad_norm=clip_grad_norm,
        plans=plans,
        synchronous_embeddings=synchronous_embeddings,
        synchronous_vectors=synchronous_vectors,
        auto_link_rate=auto_link_rate,
        auto_measure_steps=auto_measure_steps,
    )


def _is_auto(compression) -> bool:
    return isinstance(compression, str) and compression.strip().lower() == "auto"


def _refuse_auto_with_plans(param_groups: list[dict], plans) -> None:
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


def _sets_plans(param_groups: list[dict]) -> bool:
    return any(k in group for group in param_groups for k in PLAN_KEYS)


def _refuse_new_group_plans(param_groups: list[dict]) -> None:
    """An optimizer created with one plan for every parameter keeps one plan."""
    for i, group in enumerate(param_groups):
        keys = [k for k in PLAN_KEYS if k in group]
        if keys:
            raise ValueError(
                f"parameter group {i} sets {', '.join(keys)}, but this optimizer was created "
                "with one plan for every parameter: set the per-group options (or plans=) "
                "in the groups given to create_multi_node_optimizer, or pass them to the wrapper"
            )


def _part_seed(seed: int, index: int) -> int:
    """The random key of plan ``index``'s codecs (plan 0: the optimizer's seed)."""
    return (seed + index * 0x9E3779B97F4A7C15) & (2**63 - 1)


class _PlanPart:
    """One plan's parameters, buckets, hooks and schedule (see ``MultiNodeOptimizer``).

    ``on_grad_ready(part, index)`` and ``on_backward_end(part)``: the optimizer's handlers of
    this part's hooks (bound methods, held weakly: the hooks stay on the parameters).
    """

    def __init__(
        self,
        plan: Plan,
        index: int,
        codecs,
        schedule,
        counter,
        data_comm,
        *,
        on_grad_ready: Callable[[_PlanPart, int], None],
        on_backward_end: Callable[[_PlanPart], None],
    ):
        self._ready = weakref.WeakMethod(on_grad_ready)
        self._end = weakref.WeakMethod(on_backward_end)
        self.plan = plan
        self.key = str(plan)
        self.index = index
        self.codec, self.plain_codec, self.policy = codecs
        self.schedule = schedule
        self.counter = counter
        self.data_comm = data_comm
        self.release: weakref.finalize | None = None  # a communicator this part owns
        self.owned = BucketedParameters(self.grad_ready, self.backward_end)
        schedule.attach(self.owned)

    def grad_ready(self, index: int) -> None:
        handler = self._ready()
        if handler is not None:
            handler(self, index)

    def backward_end(self) -> None:
        handler = self._end()
        if handler is not None:
            handler(self)


def _combine(results: list[StepResult | None]) -> StepResult | None:
    """One agreed result over the parts that apply something this step."""
    applied = [r for r in results if r is not None]
    if not applied:
        return None
    if len(results) == 1:
        return applied[0]
    return StepResult(
        nonfinite=any(r.nonfinite for r in applied),
        bad_buckets=[b for r in applied for b in r.bad_buckets],
        present=[x for r in applied for x in r.present],
    )


class MultiNodeOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that averages gradients over a communicator.

    Public counters: ``applied_steps``, ``skipped_steps`` (NaN/Inf on some rank: every rank
    skipped the same step), ``last_step_skipped``. See :func:`create_multi_node_optimizer`.
    """

    def __init__(
        self,
        optimizer,
        comm,
        *,
        double_buffering=False,
        zero_fill=True,
        allreduce_grad_dtype=None,
        compression=None,
        overlap=True,
        bucket_cap_mb=25,
        policy=None,
        model=None,
        seed=None,
        algorithm="auto",
        clip_grad_norm=None,
        plans=None,
        synchronous_embeddings=True,
        synchronous_vectors=True,
        auto_link_rate=None,
        auto_measure_steps=3,
    ):
        if isinstance(optimizer, MultiNodeOptimizer):
            raise TypeError(
                "this optimizer is already wrapped by create_multi_node_optimizer; wrap the "
                "plain torch optimizer once (use .inner to reach it)"
            )
        check_arguments(optimizer, comm, model, algorithm, bucket_cap_mb)
        driver.release_queued()  # of optimizers dropped since (see driver.release_when_idle)
        refuse_ddp([p for g in optimizer.param_groups for p in g["params"]], model)
        self._applier = StepApplier(optimizer, rank=comm.rank, clip_grad_norm=clip_grad_norm)
        self._skip_sync = False  # inside skip_synchronize()
        self._ddp_checked = False  # the first step looks for DDP again (DDP wrapped later)
        init_hook_tables(self)
        self._inner = optimizer
        self.comm = comm
        self.double_buffering, self.compensated = parse_mode(double_buffering)
        self._user_double_buffering = double_buffering
        self.zero_fill = bool(zero_fill)
        self.overlap = bool(overlap)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.algorithm = algorithm
        # compression="auto": the first steps reduce exactly (synchronously, in step()) while
        # the compute time is measured; then rank 0's plan sets every tensor's codec.
        self._auto: AutoPlanning | None = None
        if _is_auto(compression):
            _refuse_auto_with_plans(optimizer.param_groups, plans)
            self._auto = AutoPlanning(0.0, auto_measure_steps)  # (the rate: below)
            compression, double_buffering = None, False
        self.codec, self.plain_codec, self.policy = resolve_codecs(
            comm, allreduce_grad_dtype, compression, policy
        )
        self._model_ref = weakref.ref(model) if model is not None else None
        self._counter = ReductionCounter()  # the reductions' numbers, Join's start callback
        # Plans: the wrapper's arguments are the default; groups and ``plans=`` rules may
        # choose others. One (parameters, schedule) part per distinct plan, in the order of
        # their first parameter; with one plan for everything, one part on ``_counter``.
        self._default_plan = Plan(compression, double_buffering)
        self._rules = check_rules(plans)
        # The default rule: compensated double buffering reduces embedding tables (and the
        # parameters tied to them), which carry the most per-replica jitter, and the 1-D
        # tensors (little to send) synchronously.
        self._embedding_rule = bool(synchronous_embeddings) and self.compensated
        self._vector_rule = bool(synchronous_vectors) and self.compensated
        self._rule_logged = False
        self._mixed = (
            self._auto is not None
            or bool(self._rules)
            or _sets_plans(optimizer.param_groups)
            or bool(self._rule_ids(model) & {id(p) for p in self._all_params()})
        )
        self._wire_dtype = allreduce_grad_dtype
        self._policy_arg = policy
        self._parts: list[_PlanPart] = []
        self._parts_made = 0
        self._start_seen = False  # mixed plans: the start callbacks ran for this step
        self._no_sync = False
        self._internal = 0  # >0 while our own code reads param_groups
        seed0 = int(torch.initial_seed()) & (2**63 - 1) if seed is None else int(seed)
        self.seed = int(comm.bcast_obj(seed0, root=0))
        # Gradients travel on a private duplicate of ``comm``: reductions in flight (double
        # buffering keeps one in flight between steps) never interleave with collectives
        # the application, or another wrapper, issues on ``comm`` meanwhile.
        # A stream-ordered communicator (pure_nccl, torch+nccl) is used as it is: the calling
        # thread issues everything in program order, the same on every rank, and a second
        # NCCL communicator fed in another order could deadlock (docs/design.md).
        private = comm.size > 1 and not getattr(comm, "stream_ordered", False)
        self._data_comm = comm.split(0, comm.rank) if private else comm
        # The private communicator is released by close(), or, once this optimizer is dropped,
        # by the next optimizer's creation, step or close (driver.release_when_idle).
        self._release = (
            weakref.finalize(self, driver.release_when_idle, self._data_comm) if private else None
        )
        if self._release is not None:
            self._release.atexit = False
        self._rebuild(broadcast=True)  # (every rank's settings agree, or all raise)
        if self._auto is not None:
            self._auto.link_rate = self._auto_link_rate(auto_link_rate)

    def _auto_link_rate(self, given) -> float:
        """Rank 0's allreduce rate: given, from the environment, or probed (on every rank)."""
        mine = link_rate_setting(given, self.comm.size, os.environ)
        if self.comm.size == 1:
            return mine if mine is not None else float("inf")
        rate = self.comm.bcast_obj(mine, root=0)
        if rate is None:
            params = self._all_params()
            device = params[0].device if params else torch.device("cpu")
            rate = self.comm.bcast_obj(probe_link_rate(self._data_comm, device=device), root=0)
        return float(rate)

    # -- counters (StepApplier's) --------------------------------------------------------------
    @property
    def applied_steps(self) -> int:
        """Steps the inner optimizer applied."""
        return self._applier.applied_steps

    @property
    def skipped_steps(self) -> int:
        """Steps every rank skipped (NaN/Inf gradients on some rank)."""
        return self._applier.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        return self._applier.last_step_skipped

    @property
    def clip_grad_norm(self) -> float | None:
        """The ``clip_grad_norm=`` setting (None: no clipping)."""
        return self._applier.clip_grad_norm

    @property
    def last_grad_norm(self):
        """The global norm of the last clipped step's averaged gradients, before clipping."""
        return self._applier.last_grad_norm

    # -- torch.optim.Optimizer surface ------------------------------------------------------
    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property
    def param_groups(self) -> list[dict]:
        # GradScaler.unscale_ reads gradients through param_groups: finish the reduction
        # first so that every rank inspects the same averaged gradients and takes the same
        # skip decision (local gradients would differ, and so would the decisions).
        if not self._internal and any(p.schedule.reads_synchronize for p in self._parts):
            with self._own_reads():
                for part in self._parts:  # (the double-buffered parts send in step())
                    if part.schedule.reads_synchronize:
                        part.schedule.synchronize(explicit=True)
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self._inner.param_groups = value

    state = inner_attribute("state", "_inner")
    defaults = inner_attribute("defaults", "_inner")

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # With double buffering, GradScaler hands us its scale (``self.grad_scale``) instead
        # of unscaling in place: each rank unscales its own gradients before sending them.
        return any(p.schedule.unscales_locally for p in self._parts)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, like ``torch.optim.Optimizer.zero_grad``.

        ``set_to_none=False`` (with ``zero_fill=True``) makes each ``param.grad`` a zeroed
        view of its bucket: the next backward accumulates straight into the buffer that
        will be sent, and the step copies no gradient in or out (PyTorch DDP's
        ``gradient_as_bucket_view``). The fastest choice for large models; ``None`` grads
        (the default) cost one copy per step and a fresh allocation per backward.
        """
        buffers = [(part, part.schedule.zero_grad_buffer()) for part in self._parts]
        if not set_to_none and self.zero_fill and not self._no_sync:
            views = [(p, b) for p, b in buffers if p.owned.built and b is not None]
            if len(views) == len(buffers):
                for part, buffer in views:
                    part.owned.reducer.zero_grads_into(buffer)
                return
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer; a collective call (every rank, same group)."""
        if not self._mixed:
            _refuse_new_group_plans([*self._inner.param_groups, param_group])  # before adding
        self._drain()
        for part in self._parts:  # the next step predicts again, over every group
            part.schedule.before_layout_change()
        self._inner.add_param_group(param_group)
        if self._parts and self._parts[0].owned.built:
            self._rebuild(broadcast=True)

    def __repr__(self) -> str:
        codec = self.codec.name if self.codec is not None else self.plain_codec.name
        return (
            f"MultiNodeOptimizer({type(self._inner).__name__}, comm={self.comm!r}, codec={codec}, "
            f"double_buffering={self._parts[0].schedule.mode}, overlap={self.overlap}, "
            f"zero_fill={self.zero_fill})"
        )

    def __getstate__(self):
        raise TypeError(
            "a MultiNodeOptimizer holds a communicator and cannot be pickled or "
            "deep-copied; save opt.state_dict() instead"
        )

    # -- layout: which parameters, in which buckets ------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self._inner.param_groups for p in g["params"]]

    def _rebuild(self, broadcast: bool) -> None:
        """(Re)build buckets and hooks; check every rank has the same parameters; broadcast."""
        with self._own_reads():
            groups = self._inner.param_groups
            params = self._all_params()
            model = self._model_ref() if self._model_ref is not None else None
            names = param_names(groups, model)
            check_same_model(self.comm, params, names, model)
            if broadcast:
                broadcast_from_root(self.comm, params, model)
            trainable = [i for i, p in enumerate(params) if p.requires_grad]
            if self._mixed:
                synchronous = self._rule_ids(model)
                plans = param_plans(
                    groups,
                    names,
                    self._default_plan.compression,
                    self._default_plan.double_buffering,
                    self._rules,
                    synchronous,
                )
                self._log_default_rule(
                    [
                        n
                        for n, p, pl in zip(names, params, plans)
                        if id(p) in synchronous and not pl.double_buffering
                    ]
                )
            else:
                _refuse_new_group_plans(groups)
                plans = [self._default_plan] * len(params)
            described = group_plans(groups, plans)
            if self._auto is not None:
                described["compression='auto'"] = self._auto.describe()
            check_same_plans(self.comm, described)  # before any plan's communicator
            order = list(dict.fromkeys(plans[i] for i in trainable)) or [self._default_plan]
            self._set_parts(order)
            reducers = []
            for part in self._parts:
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
                        bucket_cap_mb=self.bucket_cap_mb,
                        algorithm=self.algorithm,
                        num_buffers=2 if part.schedule.double_buffered else 1,
                        seed=_part_seed(self.seed, part.index),
                        grad_views=True,
                    )
                )
            # Every rank's wire settings agree, or all raise.
            check_same_settings(
                self, [b for r in reducers for b in r.buckets], described if self._mixed else None
            )
            for part, reducer in zip(self._parts, reducers):
                part.owned.install(reducer, params)

    def _rule_ids(self, model) -> set[int]:
        """The parameters the default rule makes synchronous by default (empty: rule off)."""
        return default_synchronous(
            model,
            self._all_params(),
            embeddings=self._embedding_rule,
            vectors=self._vector_rule,
        )

    def _log_default_rule(self, names: list[str]) -> None:
        if names and not self._rule_logged:
            self._rule_logged = True
            if self.comm.rank == 0:
                shown = ", ".join(names[:8]) + (
                    f" and {len(names) - 8} more" if len(names) > 8 else ""
                )
                log.info(
                    "commopt: double_buffering='compensated' reduces %d parameter(s) "
                    "synchronously (with overlap), the embedding tables and 1-D tensors: %s; "
                    "pass synchronous_embeddings=False or synchronous_vectors=False, or a "
                    "plans= rule, to change it",
                    len(names),
                    shown,
                )

    def _set_parts(self, order: list[Plan]) -> None:
        """Keep the parts of the plans in ``order`` (in that order), make the missing ones."""
        compensated = [p for p in order if p.double_buffering == "compensated"]
        if len(compensated) > 1:
            raise ValueError(
                "more than one compensated plan ("
                + "; ".join(str(p) for p in compensated)
                + "): give every compensated group the same compression, or make some of "
                "them double_buffering=True"
            )
        existing = {part.plan: part for part in self._parts}
        for part in self._parts:
            if part.plan not in order:  # (drained by the caller) its parameters left
                part.schedule.close()
                part.owned.remove_hooks()
                if part.release is not None:
                    part.release()
        driver.release_queued()
        self._parts = [existing.get(plan) or self._new_part(plan) for plan in order]

    def _new_part(self, plan: Plan) -> _PlanPart:
        index = self._parts_made
        self._parts_made += 1
        if plan == self._default_plan:
            codecs = (self.codec, self.plain_codec, self.policy)
        else:
            codecs = resolve_codecs(self.comm, self._wire_dtype, plan.compression, self._policy_arg)
        if self._mixed:
            counter = ReductionCounter()
            counter.on_start(self._part_starting)
        else:
            counter = self._counter
        release = None
        if index == 0 or self._data_comm is self.comm:
            data_comm = self._data_comm
        else:  # each plan's reductions on a communicator of their own: no order between plans
            data_comm = self.comm.split(0, self.comm.rank)
            release = weakref.finalize(self, driver.release_when_idle, data_comm)
            release.atexit = False
        on, compensated = parse_mode(plan.double_buffering)
        # Compensated: the prediction of the next weights (raises TypeError, naming
        # double_buffering=True, for an update rule it cannot predict).
        schedule: SynchronousSchedule | DoubleBufferedSchedule
        if on:
            schedule = DoubleBufferedSchedule(
                counter,
                zero_fill=self.zero_fill,
                ensure_layout=self._ensure_layout,
                all_params=self._all_params,
                compensation=Compensation(self._inner) if compensated else None,
            )
        else:
            schedule = SynchronousSchedule(
                counter,
                # (measuring for compression="auto": sent in step(), outside the backward)
                overlap=self.overlap and (self._auto is None or not self._auto.measuring),
                zero_fill=self.zero_fill,
                ensure_layout=self._ensure_layout,
            )
        part = _PlanPart(
            plan,
            index,
            codecs,
            schedule,
            counter,
            data_comm,
            on_grad_ready=self._on_grad_ready,
            on_backward_end=self._on_backward_end,
        )
        part.release = release
        return part

    def _part_starting(self) -> None:
        """Mixed plans: the start callbacks run once a step, as the first plan's reduction starts."""
        if not self._start_seen:
            self._start_seen = True
            self._counter.run_start_callbacks()

    def _ensure_layout(self) -> None:
        """Rebuild when the set of parameters (or their requires_grad) changed."""
        if self._parts[0].owned.changed(self._all_params()):
            self._drain()
            for part in self._parts:  # broadcast sends true weights, not predicted
                part.schedule.before_layout_change()
            self._rebuild(broadcast=True)

    # -- compression="auto" ---------------------------------------------------------------------
    @property
    def auto_plan(self) -> AutoPlan | None:
        """``compression="auto"``'s plan: each tensor's codec (None while measuring, or
        without ``"auto"``)."""
        return None if self._auto is None else self._auto.plan

    def _auto_tensors(self) -> list[TensorInfo]:
        """The trainable parameters as the planner sees them."""
        from commopt.codecs import CompressionPolicy

        groups = self._inner.param_groups
        params = self._all_params()
        model = self._model_ref() if self._model_ref is not None else None
        names = param_names(groups, model)
        policy = self._policy_arg if self._policy_arg is not None else CompressionPolicy()
        final = param_plans(
            groups, names, None, self._user_double_buffering, [], self._rule_ids(model)
        )
        return [
            TensorInfo(
                n,
                tuple(p.shape),
                compressible=policy.should_compress(n, p.shape),
                double_buffered=bool(plan.double_buffering),
                tie="compensated" if plan.double_buffering == "compensated" else None,
            )
            for n, p, plan in zip(names, params, final)
            if p.requires_grad
        ]

    def _decide_auto_plan(self) -> None:
        """Rank 0 plans from its measurements; every rank takes its JSON (a collective call)."""
        assert self._auto is not None
        self._drain()
        with self._own_reads():
            text = None
            if self.comm.rank == 0:
                exact = self.plain_codec.encoded_nbytes(1)  # the uncompressed codec's width
                params = self._all_params()
                text = self._auto.decide(
                    self._auto_tensors(),
                    exact,
                    size=self.comm.size,
                    device=params[0].device if params else None,
                ).to_json()
            if self.comm.size > 1:
                text = self.comm.bcast_obj(text, root=0)
            self._use_auto_plan(AutoPlan.from_json(text))  # type: ignore[arg-type]

    def _use_auto_plan(self, plan: AutoPlan) -> None:
        """Reduce every tensor as ``plan`` says, from the next step on (new parts)."""
        assert self._auto is not None
        mine = {t.name for t in self._auto_tensors()}
        if set(plan.choices) != mine:
            raise ValueError(
                "the automatic plan names other tensors than this optimizer's trainable "
                f"parameters (plan only: {sorted(set(plan.choices) - mine)[:5]}; parameters "
                f"only: {sorted(mine - set(plan.choices))[:5]}): load a checkpoint of the "
                "same model"
            )
        self._drain()
        for part in self._parts:  # the measuring part is idle between steps
            part.schedule.close()
            part.owned.remove_hooks()
            if part.release is not None:
                part.release()
        driver.release_queued()
        self._parts = []
        self._auto.plan = plan
        self._rules = check_rules(plan.rules())
        self._default_plan = Plan(None, self._user_double_buffering)
        self._rebuild(broadcast=False)
        if self.comm.rank == 0 and not self._auto.logged:
            self._auto.logged = True
            log.info(
                "commopt: compression='auto' chose (allreduce rate %.3g bytes/s, backward "
                "%.3g s, step %.3g s%s):\n%s",
                plan.inputs.get("link_rate", 0.0),
                plan.inputs.get("backward_s", 0.0),
                plan.inputs.get("step_s", 0.0),
                "" if plan.fits else "; the reduction does not fit even at the cheapest options",
                plan.table(),
            )

    # -- gradient hooks -----------------------------------------------------------------------
    def _on_grad_ready(self, part: _PlanPart, index: int) -> None:
        if self._no_sync:
            if part.schedule.started:
                # This step's reduction has started (or finished): these gradients would be
                # added, un-averaged, to what it sends or has already averaged.
                raise RuntimeError(
                    "a backward inside optimizer.no_sync() after this step's reduction started "
                    "(a backward outside no_sync(), or synchronize()): these gradients would "
                    "miss the average. Run every micro-batch but the last inside no_sync() and "
                    "the last one outside, then synchronize()/step()"
                )
            return
        if self._auto is not None and self._auto.measuring:
            self._auto.timer.grad_ready()
        # Once per backward: DDP's contract, the averages are in .grad when backward() returns.
        part.owned.hooks.queue_end_of_backward()
        part.schedule.grad_ready(index)

    def _on_backward_end(self, part: _PlanPart) -> None:
        """End of a backward that reached our hooks (autograd's final callback).

        ``overlap=True`` without double buffering: finish the reduction, so ``param.grad``
        holds the averaged gradients when ``backward()`` returns, as under DDP (clipping,
        GradScaler and logging then see the averages; the wait moves from ``step()`` to
        here). Otherwise the gradients stay local until ``step()``.
        """
        part.owned.hooks.end_queued = False
        if self._no_sync:
            return
        if self._auto is not None and self._auto.measuring:
            self._auto.timer.backward_end()
        with self._own_reads():
            part.schedule.backward_end()

    def on_reduction_start(self, callback: Callable[[], None]) -> RemovableHandle:
        """Run ``callback()`` as each step's reduction starts, before its first bucket.

        Every rank must register the same callbacks (they may communicate: ``commopt.Join``
        counts the ranks that still have data there). ``handle.remove()`` unregisters it.
        """
        return self._counter.on_start(callback)

    @contextlib.contextmanager
    def _own_reads(self):
        """Our own code reads ``param_groups`` inside: no implicit ``synchronize()``."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this block.

        For gradient accumulation: run every micro-batch but the last inside ``no_sync()``;
        the last backward (outside) reduces the accumulated gradients.
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    # -- synchronisation ------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the reduction now: afterwards ``param.grad`` holds the averaged gradients.

        Call it before ``GradScaler.unscale_`` or gradient clipping so they see the averages;
        ``step()`` then applies those gradients as they are. With double buffering,
        ``synchronize()`` sends this step's gradients and puts the averaged gradients of the
        previous step (the ones ``step()`` will apply) into ``param.grad``.
        """
        with self._own_reads():
            for part in self._parts:
                part.schedule.synchronize(explicit=True)

    def wait(self) -> None:
        """Block until every reduction this optimizer has started is complete.

        Afterwards no gradient of this optimizer is in flight: the averages of every bucket
        sent so far are in their buffers (``step()``/``flush()`` still decide what is
        applied), and an error a reduction met is raised here. Gradients travel on the
        optimizer's private communicator (on stream-ordered transports, on yours), so
        call this rather than waiting on the communicator, e.g. before timing or tearing down:

            >>> import torch, commopt
            >>> comm = commopt.create_communicator("local")
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = commopt.create_multi_node_optimizer(
            ...     torch.optim.SGD(model.parameters(), lr=0.1),
            ...     comm,
            ...     model=model,
            ...     double_buffering=True,
            ... )
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> opt.step()  # sends this step's gradients; applies nothing yet
            >>> opt.wait()  # that reduction has completed
            >>> opt.flush(); opt.applied_steps
            1
        """
        for comm in dict.fromkeys([self._data_comm, *(p.data_comm for p in self._parts)]):
            driver.drain(comm)

    _drain = wait  # internal call sites: "nothing of ours in flight" before a layout change

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block applies the gradients ``synchronize()`` averaged, as is.

        Horovod's pattern for changing the averaged gradients before the step (clipping)::

            loss.backward()
            optimizer.synchronize()  # param.grad: the averaged gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()

        A ``step()`` inside the block without a ``synchronize()`` since the last backward
        raises instead of applying local gradients.
        """
        previous, self._skip_sync = self._skip_sync, True
        try:
            yield
        finally:
            self._skip_sync = previous

    # -- step -----------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None):
        """Average the gradients over all ranks and apply them with the inner optimizer.

        A step where any rank had NaN/Inf gradients is skipped on every rank (counted in
        ``skipped_steps``). With double buffering the gradients applied are the previous
        step's; the first call applies nothing.
        """
        driver.release_queued()  # of optimizers dropped since (see driver.release_when_idle)
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        measuring = self._auto is not None and self._auto.measuring
        if measuring:
            self._auto.timer.step_begin()  # type: ignore[union-attr]
        loss = None
        for part in self._parts:  # (a backward that raised never ran its callback)
            part.owned.hooks.end_queued = False
        if not self._ddp_checked:  # DDP may have wrapped the model after this optimizer
            self._ddp_checked = True
            with self._own_reads():
                refuse_ddp(self._all_params(), self._model_ref() if self._model_ref else None)
        with self._own_reads():
            if closure is not None:
                loss = self._step_with_closure(closure)
            else:
                self._apply_step()
        if measuring:
            self._auto.timer.step_end()  # type: ignore[union-attr]
            if self._auto.timer.done:  # type: ignore[union-attr]
                self._decide_auto_plan()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def _apply_step(self) -> None:
        """One step over every plan: the synchronous parts' averages of this step and the
        double-buffered parts' of the previous one, behind one NaN/Inf decision and one clip."""
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        parts = list(self._parts)
        results = [
            part.schedule.result(skip_synchronize=self._skip_sync, scale=scale, found_inf=found_inf)
            for part in parts
        ]
        combined = _combine(results)
        applied: list[torch.Tensor] = []
        for part, result in zip(parts, results):
            if result is not None:
                applied += part.schedule.applied_params()
                if scale is not None and not part.schedule.unscales_locally:
                    self._unscale(part, scale, combined)
            elif combined is not None:  # (mixed plans) nothing of this plan to apply yet
                for p in part.schedule.applied_params():
                    p.grad = None
        self._applier.apply(combined, applied)
        for part, result in zip(parts, results):
            part.schedule.after_step(result, self.clip_grad_norm)
        self._start_seen = False

    @staticmethod
    def _unscale(part: _PlanPart, scale: Any, combined: StepResult | None) -> None:
        """GradScaler handed its scale over (another plan is double-buffered): this
        synchronous plan's averages are still scaled; divide them, on the device."""
        if combined is None or combined.nonfinite:
            return
        grads = [p.grad for p in part.schedule.applied_params() if p.grad is not None]
        if grads:
            inverse = inverse_grad_scale(scale)
            if isinstance(inverse, torch.Tensor):
                torch._foreach_mul_(grads, inverse.to(grads[0].dtype))
            else:
                torch._foreach_mul_(grads, inverse)

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        if not all(p.schedule.supports_closures for p in self._parts):
            raise ValueError(
                "step(closure) re-evaluates the gradients within the step, which double "
                "buffering (gradients applied one step late) cannot do: create the optimizer "
                "with double_buffering=False for closure optimizers such as LBFGS"
            )
        if self._skip_sync:
            raise RuntimeError(
                "step(closure) inside skip_synchronize(): the closure's gradients "
                "are averaged by step() itself; call step(closure) outside it"
            )
        parts = list(self._parts)

        def discard() -> None:
            for part in parts:
                part.schedule.discard()

        loss = step_with_closure(
            self._inner,
            self.comm,
            closure,
            discard=discard,
            synchronize=self.synchronize,
            clip=lambda: self._applier.clip(
                [p for x in parts for p in x.schedule.applied_params()]
            ),
        )
        self._applier.counted_closure_step()
        self._start_seen = False
        return loss

    # -- double buffering -------------------------------------------------------------------
    @contextlib.contextmanager
    def true_weights(self):
        """Inside the block the model holds the true (replicated) weights; after it, as before.

        With ``double_buffering="compensated"`` the model holds each rank's *predicted*
        weights between steps; evaluate or save the model for inference inside this block
        (or after ``flush()``, which leaves the true weights). A no-op in the other modes.

            >>> import torch, commopt
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = commopt.create_multi_node_optimizer(
            ...     torch.optim.SGD(model.parameters(), lr=0.1),
            ...     commopt.create_communicator("local"),
            ...     model=model,
            ...     double_buffering="compensated",
            ... )
            >>> model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()
            >>> before = model.weight[0, 0].item()  # predicted: one local step ahead
            >>> with opt.true_weights():
            ...     round(before - model.weight[0, 0].item(), 6)
            -0.1
        """
        with contextlib.ExitStack() as stack:
            for part in self._parts:
                stack.enter_context(part.schedule.true_weights())
            yield

    def flush(self) -> None:
        """Apply the last pending gradients (double buffering): call once after training."""
        with self._own_reads():
            parts = list(self._parts)
            results = [part.schedule.flush() for part in parts]
            combined = _combine(results)
            if combined is not None:
                applied: list[torch.Tensor] = []
                for part, result in zip(parts, results):
                    if result is not None:
                        applied += part.schedule.applied_params()
                    else:  # (mixed plans) a synchronous plan has nothing pending
                        for p in part.schedule.applied_params():
                            p.grad = None
                self._applier.apply(combined, applied)
            self._start_seen = False

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus commopt's under the key ``"commopt"``.

        commopt's part: step counters, the RNG seed, this rank's own codec state (error-feedback
        residuals, which differ per rank) and, with double buffering, the pending averaged
        gradients. No communication: with error feedback each rank saves its own state dict
        (``commopt.optim.save_checkpoint`` does, with torch.distributed.checkpoint).
        """
        with self._own_reads():
            self._drain()
            # Each schedule's state first: it completes the pending reduction.
            states = [part.schedule.state_dict() for part in self._parts]
            if self._mixed:
                extra = plans_state(
                    comm=self.comm,
                    seed=self.seed,
                    applier=self._applier,
                    parts=[
                        (part.key, part.counter, part.owned.reducer, state)
                        for part, state in zip(self._parts, states)
                    ],
                )
            else:
                extra = commopt_state(
                    comm=self.comm,
                    seed=self.seed,
                    counter=self._counter,
                    applier=self._applier,
                    schedule_state=states[0],
                    reducer=self._parts[0].owned.reducer,
                )
            if self._auto is not None and self._auto.plan is not None:
                extra["auto_plan"] = self._auto.plan.to_json()
            sd = self._inner.state_dict()
            sd["commopt"] = extra
            return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state dict from :meth:`state_dict` (or a plain optimizer's)."""
        sd = dict(state_dict)
        extra = sd.pop("commopt", None)
        with self._own_reads():
            self._drain()
            self._inner.load_state_dict(sd)
            if extra is None:
                return
            recorded = extra.get("auto_plan")
            if recorded and self._auto is None:
                raise ValueError(
                    "the checkpoint was saved by an optimizer created with compression='auto': "
                    "create this one with compression='auto' too (it resumes the recorded plan)"
                )
            if recorded and self._auto is not None:
                plan = AutoPlan.from_json(recorded)
                if plan != self._auto.plan:  # the recorded plan, not a new decision
                    self._use_auto_plan(plan)
            if self._mixed:
                self.seed, per_part = load_plans_state(
                    extra,
                    comm=self.comm,
                    applier=self._applier,
                    parts=[(p.key, p.counter, p.owned.reducer) for p in self._parts],
                )
                for part in self._parts:
                    part.owned.reducer.seed = _part_seed(self.seed, part.index)
                    part.schedule.load_state_dict(per_part[part.key], self.comm.rank)
                return
            self.seed = load_commopt_state(
                extra,
                comm=self.comm,
                counter=self._counter,
                applier=self._applier,
                reducer=self._parts[0].owned.reducer,
            )
            self._parts[0].schedule.load_state_dict(extra, self.comm.rank)

    # -- misc -------------------------------------------------------------------------------------
    @property
    def buckets(self):
        """The gradient buckets (read-only view, for inspection and tests)."""
        return [b for part in self._parts for b in part.owned.reducer.buckets]

    @property
    def schedule(self) -> SynchronousSchedule | DoubleBufferedSchedule:
        """The reduction schedule (for inspection and tests; with several plans, the first's)."""
        return self._parts[0].schedule

    @property
    def plans(self) -> dict[str, SynchronousSchedule | DoubleBufferedSchedule]:
        """Each plan (as text) and its schedule, in bucket order (for inspection and tests)."""
        return {part.key: part.schedule for part in self._parts}

    def plan_params(self, plan: str) -> list[torch.Tensor]:
        """The trainable parameters ``plan`` (a key of :attr:`plans`) reduces."""
        for part in self._parts:
            if part.key == plan:
                return list(part.owned.params)
        raise KeyError(f"no plan {plan!r}; the plans are {list(self.plans)}")

    @property
    def reductions_started(self) -> int:
        """The number the next reduction takes (the codecs' random key; for tests; with
        several plans, the first plan's)."""
        return self._parts[0].counter.next

    def close(self) -> None:
        """Wait for reductions in flight, detach the hooks, release the private communicator.

        Pending double-buffered gradients are dropped (call ``flush()`` first to apply them).
        """
        self._drain()
        self.remove_hooks()
        for part in self._parts:
            part.schedule.close()
            if part.release is not None:
                part.release()
        if self._release is not None:
            self._release()  # queues the private communicator once (drained above)
        driver.release_queued()

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the wrapper stops sending during backward)."""
        for part in self._parts:
            part.owned.remove_hooks()

    def __del__(self):
        # Only the optimizer that owns the hooks detaches them: an object of a derived class
        # that forwards attribute reads to an optimizer (Lightning's LightningOptimizer) must
        # not detach that optimizer's hooks when it is collected.
        if "_parts" not in self.__dict__:
            return
        with contextlib.suppress(Exception):  # at interpreter exit torch may be gone
            self.remove_hooks()
