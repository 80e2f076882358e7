"""``create_multi_node_optimizer``: data-parallel training by wrapping any torch optimizer.

:class:`MultiNodeOptimizer` is the ``torch.optim.Optimizer`` surface that torch, GradScaler,
LR schedulers and users call. It is composed of objects that each own their state:

- :class:`~commopt.optim.settings.Settings`: every argument, one frozen object (the
  fingerprint every rank compares is built from it);
- :class:`~commopt.optim.parts.Parts`: one *part* per plan (:mod:`~commopt.optim.plans`: the
  ``compression`` and schedule a parameter group or a ``plans=`` rule chooses; the wrapper's
  arguments are the default; one plan is one part), each with its own buckets and hooks
  (:class:`~commopt.optim.bucketed_params.BucketedParameters`) and its schedule, looked up by
  name in the registry (:mod:`commopt.optim.schedules`) and spoken to only through the
  :class:`~commopt.optim.schedules.protocol.Schedule` protocol; the rules, the default rule
  and ``compression="auto"`` live there too;
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

Schedules (docs/optimizer.md): synchronous (``overlap=True`` sends buckets during backward,
``overlap=False`` in ``step()``); ``double_buffering="stale"`` applies step t's average at step
t+1 (``flush()`` applies the last one); ``"compensated"`` does so at the weights each rank's
gradient predicts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from commopt import driver
from commopt.comm.base import Communicator
from commopt.optim._wrapping import init_hook_tables, inner_attribute
from commopt.optim.apply_step import StepApplier
from commopt.optim.auto_plan import AutoPlan, link_rate_setting, probe_link_rate
from commopt.optim.checkpoint import PartState, load_plans_state, plans_state
from commopt.optim.closures import step_with_closure
from commopt.optim.fingerprint import wire_settings
from commopt.optim.options import check_arguments, refuse_ddp
from commopt.optim.parts import Part, Parts, part_seed
from commopt.optim.plans import check_group
from commopt.optim.replicas import (
    ModelMismatchError,
    average_replicas,
    broadcast_from_root,
    check_same_model,
    param_names,
)
from commopt.optim.schedules.protocol import Schedule
from commopt.optim.settings import Settings, signature
from commopt.reducer import StepResult

__all__ = ["ModelMismatchError", "MultiNodeOptimizer", "create_multi_node_optimizer"]

log = logging.getLogger("commopt")


def create_multi_node_optimizer(
    optimizer: torch.optim.Optimizer, comm: Communicator, *args: Any, **kwargs: Any
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
    is in ``last_grad_norm``.

    The schedule (when a step's gradients are sent, which step applies them; docs/optimizer.md)
    is named by ``schedule=`` (any name in ``commopt.optim.schedules.SCHEDULES``) or by
    ``double_buffering``: False (``"synchronous"``: each step applies its own averages; with
    ``overlap=True``, the default, buckets are sent during backward, else in ``step()``),
    True or ``"compensated"`` (double buffering: the average of step t is applied at step
    t+1, at weights predicted from each rank's local gradient, which keeps synchronous
    training's accuracy; SGD, Adam, AdamW and LARS; the embedding tables and 1-D tensors stay
    synchronous by default; between steps the model holds the predicted weights: evaluate
    inside ``with opt.true_weights():`` or after ``flush()``) or ``"stale"`` (ChainerMN's plain
    double buffering: step t's average applied at the weights of step t+1, any optimizer,
    at an accuracy cost). ``schedule="local_steps"`` (DiLoCo and Streaming DiLoCo;
    docs/local-steps.md): each rank takes ``sync_every`` inner steps alone, then the mean of
    the ranks' outer gradients (anchor minus weights) updates the anchor through an outer
    optimizer, fragment by fragment. Keyword arguments other than the ones above are the
    schedules' own options (``overlap``; ``synchronous_embeddings``, ``synchronous_vectors``;
    ``sync_every``, ``outer_lr``, ``outer_momentum``, ``outer_nesterov``,
    ``outer_optimizer``, ``fragments``, ``overlap_steps``, ``fragment_alpha``,
    ``offload_anchor``), each given to every schedule that declares it.

    Per-group plans: a parameter group of ``optimizer`` may set its own ``compression`` and
    schedule (``schedule`` or ``double_buffering``; the arguments above are the defaults);
    ``plans`` (optional), a list of ``(pattern, {"compression": ..., "double_buffering": ...})``
    rules matched with ``fnmatch`` against the parameters' names in ``model``, does the same by
    name (the first matching rule wins; a group's own keys win over the rules).
    The default rule, when the default schedule is ``"compensated"`` (rank 0 logs it once; a
    rule or a group's own key still wins): ``synchronous_embeddings`` (default True), ``model``'s
    ``nn.Embedding`` weights and the parameters tied to them, and ``synchronous_vectors``
    (default True), the 1-D parameters (biases, normalisation scales), reduce synchronously
    (with ``overlap``).

    ``compression="auto"``: a codec per tensor, chosen by rank 0 after the first
    ``1 + auto_measure_steps`` steps (reduced exactly, in ``step()``, while the backward pass
    and the time between steps are measured; with local steps a candidate, the first inner
    steps of its cycle, which send nothing: where the cycle would send, its clock waits) for
    the least expected time to the target: seconds per step on a link of ``auto_link_rate``
    x the steps each option needs relative to fp32 (the package's step multipliers; a
    registered ``local_steps`` schedule is priced too when the wrapper's schedule is the
    synchronous one) (``auto_link_rate``: bytes/s, or a text such as ``"1gbit"``; default:
    the ``COMMOPT_LINK_RATE`` environment variable, else a short probe of the link at
    construction). Rank 0 broadcasts the plan as JSON, logs it as a table once, and the
    checkpoint records it (``opt.auto_plan``; docs/optimizer.md).

    Every rank must create the wrapper, call ``step()``, ``synchronize()``,
    ``add_param_group()``, ``flush()`` and ``final_sync()`` in the same order
    (``state_dict()`` starts no communication: each rank saves its own).
    """
    return MultiNodeOptimizer(optimizer, comm, Settings.of(*args, **kwargs))


create_multi_node_optimizer.__signature__ = signature("optimizer", "comm")  # type: ignore[attr-defined]


def _combine(results: list[StepResult | None]) -> StepResult | None:
    """One agreed result over the parts that apply something this step."""
    applied = [r for r in results if r is not None]
    if not applied:
        return None
    if len(applied) == 1:
        return applied[0]
    return StepResult(
        nonfinite=any(r.nonfinite for r in applied),
        bad_buckets=[b for r in applied for b in r.bad_buckets],
        present=[x for r in applied for x in r.present],
    )


class MultiNodeOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that averages gradients over a communicator.

    Public counters: ``applied_steps``, ``skipped_steps`` (NaN/Inf on some rank: every rank
    skipped the same step), ``last_step_skipped``. See :func:`create_multi_node_optimizer`
    (``MultiNodeOptimizer(optimizer, comm, ...)`` takes the same arguments).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, comm: Communicator, *args: Any, **kwargs: Any
    ):
        if isinstance(optimizer, MultiNodeOptimizer):
            raise TypeError(
                "this optimizer is already wrapped by create_multi_node_optimizer; wrap the "
                "plain torch optimizer once (use .inner to reach it)"
            )
        settings = Settings.of(*args, **kwargs)
        model = settings.model
        check_arguments(optimizer, comm, model, settings.algorithm, settings.bucket_cap_mb)
        driver.release_queued()  # of optimizers dropped since (see driver.release_when_idle)
        refuse_ddp([p for g in optimizer.param_groups for p in g["params"]], model)
        #: every argument of the wrapper (frozen; the fingerprint is built from it)
        self.settings = settings
        self._applier = StepApplier(
            optimizer, rank=comm.rank, clip_grad_norm=settings.clip_grad_norm
        )
        self._skip_sync = False  # inside skip_synchronize()
        self._ddp_checked = False  # the first step looks for DDP again (DDP wrapped later)
        init_hook_tables(self)
        self._inner = optimizer
        self.comm = comm
        self._model_ref = weakref.ref(model) if model is not None else None
        seed0 = int(torch.initial_seed()) & (2**63 - 1) if settings.seed is None else settings.seed
        self.seed = int(comm.bcast_obj(int(seed0), root=0))
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
        self._parts = Parts(
            settings,
            comm,
            self._data_comm,
            optimizer,
            seed=self.seed,
            ensure_layout=self._ensure_layout,
        )
        self._rebuild(broadcast=True)  # (every rank's settings agree, or all raise)
        if self._parts.auto is not None:
            self._parts.auto.link_rate = self._auto_link_rate(settings.auto_link_rate)

    def _auto_link_rate(self, given: object) -> float:
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

    # -- settings --------------------------------------------------------------------------------
    @property
    def zero_fill(self) -> bool:
        return bool(self.settings.zero_fill)

    @property
    def overlap(self) -> bool:
        """The ``overlap=`` setting (the synchronous schedule's option)."""
        return bool(self.settings.option("overlap", True))

    @property
    def bucket_cap_mb(self) -> float:
        return float(self.settings.bucket_cap_mb)

    @property
    def algorithm(self) -> str:
        return self.settings.algorithm

    @property
    def codec(self) -> Any:
        """The default plan's compressing codec (None: none)."""
        return self._parts.codecs[0]

    @property
    def plain_codec(self) -> Any:
        """The default plan's uncompressed codec (``allreduce_grad_dtype``)."""
        return self._parts.codecs[1]

    @property
    def policy(self) -> Any:
        return self._parts.codecs[2]

    @property
    def wire_settings(self) -> dict[str, str]:
        """This rank's settings that every rank must share, as text (what the ranks compare)."""
        return wire_settings(self.settings, self._parts.codecs, self.buckets)

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
    def last_grad_norm(self) -> float | torch.Tensor | None:
        """The global norm of the last clipped step's averaged gradients, before clipping."""
        return self._applier.last_grad_norm

    # -- torch.optim.Optimizer surface ------------------------------------------------------
    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        # GradScaler.unscale_ reads gradients through param_groups: finish the reduction
        # first so that every rank inspects the same averaged gradients and takes the same
        # skip decision (local gradients would differ, and so would the decisions).
        gate = self._parts.gate
        if not gate.internal and any(p.schedule.reads_synchronize for p in self._parts):
            with gate.own_reads():
                for part in self._parts:  # (the double-buffered parts send in step())
                    if part.schedule.reads_synchronize:
                        part.schedule.synchronize(explicit=True)
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
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
        if not set_to_none and self.zero_fill and not self._parts.gate.accumulating:
            views = [(p, b) for p, b in buffers if p.owned.built and b is not None]
            if len(views) == len(buffers):
                for part, buffer in views:
                    part.owned.reducer.zero_grads_into(buffer)
                return
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer; a collective call (every rank, same group).

        A group with a plan of its own (``compression``, ``schedule`` or ``double_buffering``)
        gets a part of its own, as a group given at construction would.
        """
        check_group(param_group, f"parameter group {len(self._inner.param_groups)}")
        self._drain()
        for part in self._parts:  # the next step predicts again, over every group
            part.schedule.before_layout_change()
        self._inner.add_param_group(param_group)
        if len(self._parts) and self._parts.first.owned.built:
            self._rebuild(broadcast=True)

    def __repr__(self) -> str:
        codec = self.codec.name if self.codec is not None else self.plain_codec.name
        return (
            f"MultiNodeOptimizer({type(self._inner).__name__}, comm={self.comm!r}, codec={codec}, "
            f"double_buffering={self._parts.first.schedule.name}, overlap={self.overlap}, "
            f"zero_fill={self.zero_fill})"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a MultiNodeOptimizer holds a communicator and cannot be pickled or "
            "deep-copied; save opt.state_dict() instead"
        )

    # -- layout: which parameters, in which buckets ------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self._inner.param_groups for p in g["params"]]

    def _model(self) -> torch.nn.Module | None:
        return self._model_ref() if self._model_ref is not None else None

    def _rebuild(self, broadcast: bool) -> None:
        """(Re)build parts, buckets and hooks; check every rank has the same parameters."""
        with self._parts.gate.own_reads():
            groups = self._inner.param_groups
            params = self._all_params()
            model = self._model()
            names = param_names(groups, model)
            check_same_model(self.comm, params, names, model)
            if broadcast:
                broadcast_from_root(self.comm, params, model)
            self._parts.build(groups, params, names, model)

    def _ensure_layout(self) -> None:
        """Rebuild when the set of parameters (or their requires_grad) changed."""
        if self._parts.first.owned.changed(self._all_params()):
            self._drain()
            for part in self._parts:  # broadcast sends true weights, not predicted
                part.schedule.before_layout_change()
            self._rebuild(broadcast=True)

    # -- compression="auto" ---------------------------------------------------------------------
    @property
    def auto_plan(self) -> AutoPlan | None:
        """``compression="auto"``'s plan: each tensor's codec (None while measuring, or
        without ``"auto"``)."""
        auto = self._parts.auto
        return None if auto is None else auto.plan

    def _decide_auto_plan(self) -> None:
        """Rank 0 plans from its measurements; every rank takes its JSON (a collective call)."""
        auto = self._parts.auto
        assert auto is not None
        self._drain()
        with self._parts.gate.own_reads():
            text = None
            if self.comm.rank == 0:
                exact = self.plain_codec.encoded_nbytes(1)  # the uncompressed codec's width
                params = self._all_params()
                text = auto.decide(
                    self._parts.auto_tensors(self._model()),
                    exact,
                    size=self.comm.size,
                    device=params[0].device if params else None,
                ).to_json()
            if self.comm.size > 1:
                text = self.comm.bcast_obj(text, root=0)
            self._use_auto_plan(AutoPlan.from_json(text))  # type: ignore[arg-type]

    def _use_auto_plan(self, plan: AutoPlan) -> None:
        """Reduce every tensor as ``plan`` says, from the next step on (new parts)."""
        auto = self._parts.auto
        assert auto is not None
        self._drain()
        # Measured on local steps: the plan's local-steps parts take their cycle up;
        # otherwise (another schedule) the ranks' weights are averaged once and their inner
        # state made rank 0's.
        apart = [not part.schedule.reduces_every_step for part in self._parts]
        carried = [part.schedule.cycle_state() for part in self._parts]
        self._parts.use_auto_plan(plan, self._model())
        self._rebuild(broadcast=False)
        cycles = [c for c in carried if c is not None]
        continued = False
        if cycles and len(cycles) == sum(apart):
            anchors = {k: v for c in cycles for k, v in c["anchors"].items()}
            whole = {**cycles[0], "anchors": anchors}
            taken = [part.schedule.continue_cycle(whole) for part in self._parts]  # (each)
            continued = all(taken)
        if any(apart) and not continued:
            with self._parts.gate.own_reads():
                average_replicas(self.comm, self._all_params(), self._inner)
        if self.comm.rank == 0 and not auto.logged:
            auto.logged = True
            log.info(
                "commopt: compression='auto' chose (allreduce rate %.3g bytes/s, backward "
                "%.3g s, step %.3g s%s):\n%s\n%s",
                plan.inputs.get("link_rate", 0.0),
                plan.inputs.get("backward_s", 0.0),
                plan.inputs.get("step_s", 0.0),
                "" if plan.fits else "; the reduction is not hidden under compute",
                plan.table(),
                plan.summary(),
            )

    # -- gradient hooks -----------------------------------------------------------------------
    def on_reduction_start(self, callback: Callable[[], None]) -> RemovableHandle:
        """Run ``callback()`` as each step's reduction starts, before its first bucket.

        Every rank must register the same callbacks (they may communicate: ``commopt.Join``
        counts the ranks that still have data there). ``handle.remove()`` unregisters it.
        """
        return self._parts.start_callbacks.add(callback)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside this block.

        For gradient accumulation: run every micro-batch but the last inside ``no_sync()``;
        the last backward (outside) reduces the accumulated gradients.
        """
        gate = self._parts.gate
        previous, gate.accumulating = gate.accumulating, True
        try:
            yield
        finally:
            gate.accumulating = previous

    # -- synchronisation ------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the reduction now: afterwards ``param.grad`` holds the averaged gradients.

        Call it before ``GradScaler.unscale_`` or gradient clipping so they see the averages;
        ``step()`` then applies those gradients as they are. With double buffering,
        ``synchronize()`` sends this step's gradients and puts the averaged gradients of the
        previous step (the ones ``step()`` will apply) into ``param.grad``.
        """
        with self._parts.gate.own_reads():
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
            ...     double_buffering="stale",
            ... )
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> opt.step()  # sends this step's gradients; applies nothing yet
            >>> opt.wait()  # that reduction has completed
            >>> opt.flush(); opt.applied_steps
            1
        """
        for comm in dict.fromkeys([self._data_comm, *(p.data_comm for p in self._parts)]):
            driver.drain(comm)

        for comm in self._parts.data_comms():
            driver.drain(comm)

    _drain = wait  # internal call sites: "nothing of ours in flight" before a layout change

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
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
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average the gradients over all ranks and apply them with the inner optimizer.

        A step where any rank had NaN/Inf gradients is skipped on every rank (counted in
        ``skipped_steps``). With double buffering the gradients applied are the previous
        step's; the first call applies nothing.
        """
        driver.release_queued()  # of optimizers dropped since (see driver.release_when_idle)
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        timer = self._parts.gate.timer  # compression="auto" measuring
        if timer is not None:
            timer.step_begin()
        loss = None
        for part in self._parts:  # (a backward that raised never ran its callback)
            part.owned.hooks.forget_end()
        if not self._ddp_checked:  # DDP may have wrapped the model after this optimizer
            self._ddp_checked = True
            with self._parts.gate.own_reads():
                refuse_ddp(self._all_params(), self._model())
        with self._parts.gate.own_reads():
            if closure is not None:
                loss = self._step_with_closure(closure)
            else:
                self._apply_step()
        if timer is not None:
            timer.step_end()
            if timer.done:
                self._decide_auto_plan()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def _apply(self, parts: list[Part], results: list[StepResult | None], scale: Any) -> None:
        """Apply the parts' results behind one NaN/Inf decision and one clip; a part with
        nothing to apply this step (a synchronous part while a double-buffered one waits,
        or the other way round) has its gradients set to None."""
        combined = _combine(results)
        if combined is None:
            return self._applier.apply(None, [])
        applied: list[torch.Tensor] = []
        for part, result in zip(parts, results):
            if result is None:
                for p in part.schedule.applied_params():
                    p.grad = None
                continue
            applied += part.schedule.applied_params()
            if scale is not None and not part.schedule.unscales_locally and not combined.nonfinite:
                # GradScaler handed its scale over (another part unscales locally): this
                # part's averages are still scaled.
                self._applier.unscale(part.schedule.applied_params(), scale)
        self._applier.apply(combined, applied)

    def _apply_step(self) -> None:
        """One step over every part: each schedule's averages to apply (a synchronous part's
        of this step, a double-buffered one's of the previous step)."""
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        parts = list(self._parts)
        results = [
            part.schedule.result(skip_synchronize=self._skip_sync, scale=scale, found_inf=found_inf)
            for part in parts
        ]
        self._apply(parts, results, scale)
        for part, result in zip(parts, results):
            part.schedule.after_step(result, self.clip_grad_norm)
        self._parts.start_callbacks.step_done()

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        refusing = [p.schedule for p in self._parts if not p.schedule.supports_closures]
        if refusing:
            raise ValueError(
                "step(closure) re-evaluates the gradients within the step, which "
                f"{refusing[0].closure_refusal} cannot do: create the optimizer with "
                f"{refusing[0].closure_fix} for closure optimizers such as LBFGS"
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
        self._parts.start_callbacks.step_done()
        return loss

    # -- schedules that predict the weights -----------------------------------------------------
    @property
    def predicts_weights(self) -> bool:
        """Whether a part's schedule moves the model to predicted weights between steps
        (then evaluate or save inside :meth:`true_weights`)."""
        return any(part.schedule.predicts_weights for part in self._parts)

    @property
    def holds_local_weights(self) -> bool:
        """Whether the model may hold this rank's own weights between steps: predicted ones
        (compensated double buffering) or local ones (local steps). Then evaluate or save
        for inference inside :meth:`true_weights`, which shows the weights the ranks agree on."""
        return any(
            part.schedule.predicts_weights or not part.schedule.reduces_every_step
            for part in self._parts
        )

    @contextlib.contextmanager
    def true_weights(self) -> Iterator[None]:
        """Inside the block the model holds the true (replicated) weights; after it, as before.

        With ``double_buffering="compensated"`` the model holds each rank's *predicted*
        weights between steps; evaluate or save the model for inference inside this block
        (or after ``flush()``, which leaves the true weights). Under local steps the block
        shows the anchor, the weights every rank agreed on at the last synchronisation. A
        no-op in the other modes.

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
        with self._parts.gate.own_reads():
            parts = list(self._parts)
            results = [part.schedule.flush() for part in parts]
            if _combine(results) is not None:
                self._apply(parts, results, None)
            self._parts.start_callbacks.step_done()

    def final_sync(self) -> None:
        """End of training: apply what is pending and bring every rank to the agreed weights.

        Under local steps (``schedule="local_steps"``) each fragment with inner steps since
        its last synchronisation synchronises now (its outer step taken) and the model holds
        the anchor on every rank; in the other modes this is :meth:`flush`. A collective
        call: every rank calls it at the same step, instead of :meth:`flush`.
        """
        with self._parts.gate.own_reads():
            for part in self._parts:
                part.schedule.final_sync()
        self.flush()

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus commopt's under the key ``"commopt"``.

        commopt's part: step counters, the RNG seed, this rank's own codec state (error-feedback
        residuals, which differ per rank) and, with double buffering, the pending averaged
        gradients. No communication: with error feedback each rank saves its own state dict
        (``commopt.optim.save_checkpoint`` does, with torch.distributed.checkpoint).
        """
        with self._parts.gate.own_reads():
            self._drain()
            # Each schedule's state first: it completes the pending reduction.
            states = [part.schedule.state_dict() for part in self._parts]
            extra = plans_state(
                comm=self.comm,
                seed=self.seed,
                applier=self._applier,
                parts=[
                    PartState(
                        part.key,
                        part.counter,
                        part.owned.reducer,
                        state,
                        part.schedule.own_keys,
                    )
                    for part, state in zip(self._parts, states)
                ],
            )
            auto = self._parts.auto
            if auto is not None and auto.plan is not None:
                extra["auto_plan"] = auto.plan.to_json()
            sd = self._inner.state_dict()
            sd["commopt"] = extra
            return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state dict from :meth:`state_dict` (or a plain optimizer's, or one an
        earlier commopt wrote: it loads as what it was)."""
        sd = dict(state_dict)
        extra = sd.pop("commopt", None)
        with self._parts.gate.own_reads():
            self._drain()
            self._inner.load_state_dict(sd)
            if extra is None:
                return
            recorded = extra.get("auto_plan")
            auto = self._parts.auto
            if recorded and auto is None:
                raise ValueError(
                    "the checkpoint was saved by an optimizer created with compression='auto': "
                    "create this one with compression='auto' too (it resumes the recorded plan)"
                )
            if recorded and auto is not None:
                plan = AutoPlan.from_json(recorded)
                if plan != auto.plan:  # the recorded plan, not a new decision
                    self._use_auto_plan(plan)
            parts = list(self._parts)
            self.seed, per_part = load_plans_state(
                extra,
                comm=self.comm,
                applier=self._applier,
                parts=[PartState(p.key, p.counter, p.owned.reducer) for p in parts],
            )
            self._parts.seed = self.seed
            for part in parts:
                part.owned.reducer.seed = part_seed(self.seed, part.index)
                part.schedule.load_state_dict(per_part[part.key], self.comm.rank)

    # -- inspection ---------------------------------------------------------------------------------
    @property
    def buckets(self) -> list[Any]:
        """The gradient buckets (read-only view, for inspection and tests)."""
        return [b for part in self._parts for b in part.owned.reducer.buckets]

    @property
    def schedule(self) -> Schedule:
        """The reduction schedule (for inspection and tests; with several plans, the first's)."""
        return self._parts.first.schedule

    @property
    def plans(self) -> dict[str, Schedule]:
        """Each plan (as text) and its schedule, in bucket order (for inspection and tests)."""
        return {part.key: part.schedule for part in self._parts}

    def plan_params(self, plan: str) -> list[torch.Tensor]:
        """The trainable parameters ``plan`` (a key of :attr:`plans`) reduces."""
        return list(self._parts.by_key(plan).owned.params)

    @property
    def reductions_started(self) -> int:
        """The number the next reduction takes (the codecs' random key; for tests; with
        several plans, the first plan's)."""
        return self._parts.first.counter.next

    def close(self) -> None:
        """Wait for reductions in flight, detach the hooks, release the private communicator.

        Pending double-buffered gradients are dropped (call ``flush()`` first to apply them).
        """
        self._drain()
        self._parts.close()
        if self._release is not None:
            self._release()  # queues the private communicator once (drained above)
        driver.release_queued()

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the wrapper stops sending during backward)."""
        for part in self._parts:
            part.owned.remove_hooks()

    def __del__(self) -> None:
        # Only the optimizer that owns the hooks detaches them: an object of a derived class
        # that forwards attribute reads to an optimizer (Lightning's LightningOptimizer) must
        # not detach that optimizer's hooks when it is collected.
        if "_parts" not in self.__dict__:
            return
        with contextlib.suppress(Exception):  # at interpreter exit torch may be gone
            self.remove_hooks()


MultiNodeOptimizer.__init__.__signature__ = signature("self", "optimizer", "comm")  # type: ignore[attr-defined]
