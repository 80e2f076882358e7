"""The local-steps schedule: inner steps touch no network; every ``sync_every`` steps the
workers' parameter changes are averaged and applied by an outer optimizer (DiLoCo), optionally
fragment by fragment, each fragment's reduction overlapping inner steps (Streaming DiLoCo).

:class:`LocalStepsSchedule` (``schedule="local_steps"``) lets the inner optimizer step on each
rank's own gradient: its :meth:`~LocalStepsSchedule.result` reduces nothing. It keeps an
*anchor*, the weights every rank agreed on at the last synchronisation, and an outer
optimizer over it. The part's parameters are split into ``fragments`` of near-equal bytes
(:func:`balanced_fragments`; each fragment's tensors in the part's order, fragment 0 holding
the first tensor); fragment ``f`` synchronises after the inner steps ``t`` with
``t % sync_every == (f + 1) * sync_every // fragments % sync_every`` (staggered; one fragment:
every ``sync_every`` steps). A synchronisation:

1. ``overlap_steps`` inner steps before (0: then), the outer gradient ``anchor - weights`` of
   the fragment is sent to be averaged over the ranks, with the part's codecs, each fragment
   with error feedback of its own where the codec has it (a slot whose start would come
   before the first step is skipped);
2. after step ``t`` the outer optimizer (default: SGD with Nesterov momentum,
   ``outer_lr=0.7``, ``outer_momentum=0.9``) steps the anchor with that average;
3. the weights become the anchor (``overlap_steps=0``), or, with overlap, the mix
   ``fragment_alpha * weights + (1 - fragment_alpha) * anchor`` of the weights the inner
   steps reached meanwhile and the new anchor.

``sync_every=1``, an outer SGD with ``outer_lr=1`` and no momentum, and an inner SGD without
momentum give the synchronous schedule's weights up to rounding: the anchor becomes
``w - (w - mean_r(w - lr * g_r))`` instead of ``w - lr * mean_r(g_r)``.

Memory: the anchor and the outer optimizer's state (Nesterov: one momentum buffer) cost two
copies of the part's parameters (``offload_anchor=True`` keeps both in CPU memory, pinned
when CUDA is available), and the outer gradients' buckets one more copy in the reduction's
dtype on the parameters' device.

    >>> import torch, commopt
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = commopt.create_multi_node_optimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1),
    ...     commopt.create_communicator("local"),
    ...     model=model,
    ...     schedule="local_steps",
    ...     sync_every=4,
    ... )
    >>> for _ in range(3):
    ...     model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()
    >>> opt.schedule.position, opt.applied_steps  # three local steps, no reduction yet
    (3, 3)
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from commopt import kernels
from commopt.optim.apply_step import inverse_grad_scale
from commopt.optim.schedules.protocol import ScheduleBase, ScheduleContext
from commopt.reducer import GradientReducer, StepReduction, StepResult

__all__ = ["LocalStepsOptions", "LocalStepsSchedule", "balanced_fragments", "sync_steps"]

log = logging.getLogger("commopt")


@dataclass(frozen=True)
class LocalStepsOptions:
    """The local-steps schedule's options (keyword arguments of ``create_multi_node_optimizer``).

    ``sync_every``: inner steps between two synchronisations of a fragment (H);
    ``outer_lr``, ``outer_momentum``, ``outer_nesterov``: the default outer optimizer, SGD;
    ``outer_optimizer``: instead, a callable ``params -> torch.optim.Optimizer`` (called once
    per fragment with the fragment's anchor tensors); ``fragments``: how many fragments (P)
    synchronise on a staggered schedule; ``overlap_steps``: inner steps a fragment's
    reduction overlaps before it is applied (tau, below ``sync_every``); ``fragment_alpha``:
    with overlap, the share of the local weights in the merge with the new anchor;
    ``offload_anchor``: keep the anchor and the outer optimizer's state in CPU memory.
    """

    sync_every: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None
    fragments: int = 1
    overlap_steps: int = 0
    fragment_alpha: float = 0.5
    offload_anchor: bool = False


def _check_options(o: LocalStepsOptions) -> None:
    """Refuse options that cannot describe a schedule, saying what to pass."""

    def whole(name: str, value: Any, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        return value

    every = whole("sync_every", o.sync_every, 1)
    parts = whole("fragments", o.fragments, 1)
    tau = whole("overlap_steps", o.overlap_steps, 0)
    if parts > every:
        raise ValueError(
            f"fragments={parts} > sync_every={every}: each fragment synchronises at its own "
            "inner step of the cycle; pass fragments <= sync_every"
        )
    if tau >= every:
        raise ValueError(
            f"overlap_steps={tau} must be below sync_every={every} (a fragment's reduction "
            "ends before the fragment synchronises again)"
        )
    for name in ("outer_lr", "outer_momentum"):
        value = getattr(o, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value >= 0)
        ):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    alpha = o.fragment_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"fragment_alpha must be a number in [0, 1], got {alpha!r}")
    if o.outer_optimizer is not None and not callable(o.outer_optimizer):
        raise ValueError(
            "outer_optimizer must be a callable params -> torch.optim.Optimizer (for example "
            "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)), got "
            f"{o.outer_optimizer!r}"
        )


class _Decided:
    """A compression policy that repeats the part's decision for each tensor (by name)."""

    def __init__(self, compressed: set[str]) -> None:
        self.compressed = compressed

    def should_compress(self, name: str, shape: Any) -> bool:
        return name in self.compressed

    def __repr__(self) -> str:
        return f"_Decided({sorted(self.compressed)})"


class _Fragment:
    """One fragment: its parameters, anchor, outer optimizer and outer-gradient reducer."""

    def __init__(
        self,
        index: int,
        members: list[int],
        params: list[torch.Tensor],
        anchors: list[torch.Tensor],
        carriers: list[torch.Tensor],
        reducer: GradientReducer,
        outer: torch.optim.Optimizer,
        offset: int,
    ) -> None:
        self.index = index
        self.members = members  # its tensors' positions in the part's parameters
        self.params = params
        self.anchors = anchors  # the agreed weights (on the parameters' device or on the CPU)
        self.carriers = carriers  # the reducer's tensors: the anchors, or device stand-ins
        self.reducer = reducer
        self.outer = outer
        self.offset = offset  # the inner step of the cycle (mod sync_every) it synchronises at
        self.in_flight: StepReduction | None = None
        self.due = 0  # the inner step whose end applies the reduction in flight
        #: the position at which the weights last became the anchor (-1: merged since)
        self.synced_at = 0


class LocalStepsSchedule(ScheduleBase):
    """Local inner steps; the averaged parameter changes applied by an outer optimizer every
    ``sync_every`` steps, per fragment, optionally overlapped (``"local_steps"``)."""

    name = "local_steps"
    options = LocalStepsOptions
    supports_closures = False
    closure_refusal = "local steps (averages applied only every few steps)"
    reduces_every_step = False  # inner steps send nothing
    #: GradScaler hands over its scale and calls ``step()`` on every rank, whatever this
    #: rank's gradients hold: each rank unscales its own gradients and skips its own inner step
    #: on NaN/Inf, so the ranks' step counts, and with them their synchronisations, stay equal.
    unscales_locally = True
    checkpoint_keys = ("anchor", "outer_state", "cycle", "outer_residuals", "local_state")
    #: this rank's own: its error feedback of the outer gradients, and its weights and inner
    #: optimizer state of the part (they differ between ranks between synchronisations)
    own_keys = ("outer_residuals", "local_state")

    def __init__(self, context: ScheduleContext, options: LocalStepsOptions | None = None):
        super().__init__(context, options)
        _check_options(self.settings)
        o = self.settings
        self.sync_every = int(o.sync_every)
        self.num_fragments = int(o.fragments)
        self.overlap_steps = int(o.overlap_steps)
        self.alpha = float(o.fragment_alpha)
        self.position = 0  # inner steps since the fragments were built
        #: inner steps on which this rank's gradients held NaN/Inf (its inner step skipped)
        self.local_skipped_steps = 0
        self.fragments: list[_Fragment] = []
        self._built_for: tuple[int, ...] | None = None
        self._checked = False  # every rank's options compared (at the first step)
        #: a replaced part's cycle to take up when the fragments are built
        self._continued: dict[str, Any] | None = None
        #: a checkpoint's split of the tensors into fragments, for the next build
        self._saved_members: list[list[int]] | None = None

    # -- building the fragments (the part's buckets are installed after construction) ------
    def _ensure_fragments(self) -> list[_Fragment]:
        params = self.bucketed.params
        key = tuple(id(p) for p in params)
        if key == self._built_for:
            return self.fragments
        if self._built_for is not None:
            self._finish_all()
            log.warning(
                "commopt: the local-steps part's parameters changed: its anchor and outer "
                "optimizer state restart from the current weights"
            )
        self.fragments = self._build(params, self._saved_members)
        self._saved_members = None
        self._built_for = key
        self.position = 0
        if self._continued is not None:
            self._take_up(self._continued)
            self._continued = None
        return self.fragments

    @classmethod
    def quiet_steps(cls, options: Any) -> int:
        """The steps before the first fragment's outer gradient is sent.

        >>> LocalStepsSchedule.quiet_steps(LocalStepsOptions(sync_every=16))
        15
        >>> LocalStepsSchedule.quiet_steps(
        ...     LocalStepsOptions(sync_every=16, fragments=2, overlap_steps=1))
        6
        """
        every, tau = int(options.sync_every), int(options.overlap_steps)
        first = min(
            next(t for t in range(1, every + tau + 1) if (t + tau) % every == off)
            for off in (_offset(f, int(options.fragments), every) for f in range(options.fragments))
        )
        return first - 1

    def cycle_state(self) -> dict[str, Any] | None:
        """The anchor of each parameter and the position in the cycle, while no fragment has
        sent yet (later: None, nothing a new part could take up exactly)."""
        if (
            not self.fragments
            or self.position > self.quiet_steps(self.settings)
            or any(f.in_flight is not None for f in self.fragments)
        ):
            return None
        anchors = {id(p): a for f in self.fragments for p, a in zip(f.params, f.anchors)}
        return {
            "local_steps": (self.sync_every, self.num_fragments, self.overlap_steps),
            "position": self.position,
            "anchors": anchors,
        }

    def continue_cycle(self, state: dict[str, Any]) -> bool:
        """Start from ``state``'s anchors and position (at the first step, which builds the
        fragments) when it is a cycle of this schedule's options."""
        if state.get("local_steps") != (self.sync_every, self.num_fragments, self.overlap_steps):
            return False
        self._continued = state
        return True

    def _take_up(self, state: dict[str, Any]) -> None:
        anchors = state["anchors"]
        with torch.no_grad():
            for f in self.fragments:
                for p, a in zip(f.params, f.anchors):
                    a.copy_(anchors[id(p)])
        self.position = int(state["position"])

    def _build(
        self, params: list[torch.Tensor], split: list[list[int]] | None = None
    ) -> list[_Fragment]:
        owned = self.bucketed.reducer
        o = self.settings
        if self.num_fragments > max(1, len(params)):
            raise ValueError(
                f"fragments={self.num_fragments} but the local-steps part has "
                f"{len(params)} trainable tensor(s): pass fragments <= {max(1, len(params))}"
            )
        compressed_codec, plain_codec = None, None
        compressed: set[str] = set()
        for b in owned.buckets:
            for s in b.slots:
                if b.compressed:
                    compressed.add(owned.names[s.param])
            if b.compressed and compressed_codec is None:
                compressed_codec = b.codec
            elif not b.compressed and b.dtype == torch.float32 and plain_codec is None:
                plain_codec = b.codec
        pin = bool(o.offload_anchor) and torch.cuda.is_available()
        if split is None:
            sizes = [p.numel() * p.element_size() for p in params]
            split = balanced_fragments(sizes, self.num_fragments) if params else [[]]
        fragments = []
        for f, mine in enumerate(split):
            ps = [params[i] for i in mine]
            with torch.no_grad():
                if o.offload_anchor:
                    anchors = [
                        p.detach().to("cpu", copy=True).pin_memory()
                        if pin
                        else p.detach().to("cpu", copy=True)
                        for p in ps
                    ]
                    # Stand-ins of the parameters' shape, dtype and device holding one element:
                    # the reducer reads their .grad (set for one reduction, then dropped).
                    carriers = [
                        torch.empty_strided(p.shape, (0,) * p.dim(), dtype=p.dtype, device=p.device)
                        for p in ps
                    ]
                else:
                    anchors = [p.detach().clone() for p in ps]
                    carriers = anchors
            reducer = GradientReducer(
                owned.comm,
                carriers,
                [owned.names[i] for i in mine],
                # (fresh codec objects: each fragment keeps its own error feedback)
                codec=copy.deepcopy(compressed_codec),
                plain_codec=copy.deepcopy(plain_codec),
                policy=_Decided(compressed),
                algorithm=owned.algorithm,
                seed=(owned.seed + 0x632BE59BD9B4E019 * (f + 1)) & (2**63 - 1),
            )
            if o.outer_optimizer is not None:
                outer = o.outer_optimizer(anchors)
            else:
                outer = torch.optim.SGD(
                    anchors,
                    lr=float(o.outer_lr),
                    momentum=float(o.outer_momentum),
                    nesterov=bool(o.outer_nesterov) and o.outer_momentum > 0,
                )
            offset = _offset(f, self.num_fragments, self.sync_every)
            fragments.append(_Fragment(f, mine, ps, anchors, carriers, reducer, outer, offset))
        return fragments

    def _check_same_options(self, comm: Any) -> None:
        """Every rank synchronises at the same steps, or all raise (a collective call)."""
        if comm.size == 1:
            return
        o = self.settings
        mine = (self.sync_every, self.num_fragments, self.overlap_steps, bool(o.offload_anchor))
        everyone = comm.allgather_obj(repr(mine))
        if len(set(everyone)) > 1:
            sides = "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
            raise ValueError(
                f"rank {comm.rank}: the ranks created the local-steps schedule with different "
                f"(sync_every, fragments, overlap_steps, offload_anchor): {sides}. Pass the "
                "same on every rank"
            )

    # -- inspection ---------------------------------------------------------------------------
    @property
    def in_flight(self) -> list[int]:
        """The fragments whose reduction is in flight."""
        return [f.index for f in self.fragments if f.in_flight is not None]

    @property
    def anchor(self) -> list[torch.Tensor]:
        """The agreed weights, in the part's parameter order."""
        out: list[torch.Tensor | None] = [None] * sum(len(f.anchors) for f in self.fragments)
        for f in self.fragments:
            for i, a in zip(f.members, f.anchors):
                out[i] = a
        return [a for a in out if a is not None]

    # -- events ---------------------------------------------------------------------------
    def synchronize(self, explicit: bool = True) -> None:
        """Nothing to average: each rank's inner step applies its own gradients."""
        self.guard.clear()

    def result(
        self, *, skip_synchronize: bool, scale: Any = None, found_inf: Any = None
    ) -> StepResult | None:
        """This rank's own gradients, reduced with no one: the inner step applies them.

        A rank whose gradients hold NaN/Inf skips its inner step on this part (its gradients
        set to None; ``local_skipped_steps`` counts it); the other ranks step on. ``scale``:
        GradScaler's scale when it drives this step (the gradients are unscaled here first).
        """
        self._ensure_fragments()
        if not self._checked:
            self._check_same_options(self.bucketed.reducer.comm)
            self._checked = True
        self.guard.clear()
        params = self.bucketed.params
        grads = [p.grad for p in params if p.grad is not None]
        if scale is not None:
            inverse = inverse_grad_scale(scale)
            for g in grads:
                g.mul_(inverse)
        if kernels.any_nonfinite(grads):
            self.local_skipped_steps += 1
            log.warning(
                "commopt: rank %d skipped its local inner step: NaN/Inf gradients "
                "(%d local step(s) skipped so far)",
                self.bucketed.reducer.comm.rank,
                self.local_skipped_steps,
            )
            for p in params:
                p.grad = None
        return StepResult(
            nonfinite=False, bad_buckets=[], present=[p.grad is not None for p in params]
        )

    def after_step(self, result: StepResult | None, max_norm: float | None) -> None:
        """One inner step more: apply the reductions due, start the fragments whose turn it is.

        While ``compression="auto"`` measures (``defer_to_step``), nothing is sent: a step
        after which a fragment would start holds the cycle's clock instead (the cycle goes on
        from there under the plan)."""
        fragments = self._ensure_fragments()
        t = self.position + 1
        starting = [f for f in fragments if (t + self.overlap_steps) % self.sync_every == f.offset]
        if starting and self.context.defer_to_step:
            return
        self.position = t
        for f in fragments:
            if f.in_flight is not None and f.due <= t:
                self._finish(f)
        for f in starting:
            self._start(f)
            if self.overlap_steps == 0:
                self._finish(f)
            else:
                f.due = t + self.overlap_steps

    def _start(self, f: _Fragment) -> None:
        """Send the fragment's outer gradient, ``anchor - weights``."""
        with torch.no_grad():
            for a, p, c in zip(f.anchors, f.params, f.carriers):
                c.grad = a.to(p.device) - p.detach()
            f.in_flight = self.counter.start(f.reducer)
            f.in_flight.issue_remaining()  # (packed: the stand-ins' gradients can go)
            if f.carriers is not f.anchors:
                for c in f.carriers:
                    c.grad = None

    def _finish(self, f: _Fragment, merge: bool = True) -> None:
        """Apply the fragment's averaged outer gradient: outer step, then move the weights
        (to the anchor, or with overlap and ``merge`` to the mix with the local weights)."""
        red = f.in_flight
        assert red is not None
        f.in_flight = None
        red.write_averages(zero_fill=True)
        agreed = red.result()
        with torch.no_grad():
            if agreed.nonfinite:
                # Some rank's weights held NaN/Inf: every rank skips the outer step and goes
                # back to the agreed weights (the error feedback forgot this reduction).
                if red.reducer.comm.rank == 0:
                    log.warning(
                        "commopt: fragment %d's outer step skipped on every rank: NaN/Inf in "
                        "some rank's weights; the weights go back to the anchor",
                        f.index,
                    )
                for p, a in zip(f.params, f.anchors):
                    p.copy_(a.to(p.device))
                f.synced_at = self.position
            else:
                if f.carriers is not f.anchors:
                    for a, c in zip(f.anchors, f.carriers):
                        a.grad = None if c.grad is None else c.grad.to(a.device)
                        c.grad = None
                f.outer.step()
                if self.overlap_steps == 0 or self.alpha == 0.0 or not merge:
                    for p, a in zip(f.params, f.anchors):
                        p.copy_(a.to(p.device))
                    f.synced_at = self.position
                else:
                    f.synced_at = -1
                    mixed = [
                        a.to(p.device) * (1.0 - self.alpha) for p, a in zip(f.params, f.anchors)
                    ]
                    for p, m in zip(f.params, mixed):
                        p.mul_(self.alpha).add_(m)
            for a in f.anchors:
                a.grad = None

    def _finish_all(self) -> None:
        for f in self.fragments:
            if f.in_flight is not None:
                self._finish(f)

    def flush(self) -> StepResult | None:
        """Apply every fragment's reduction in flight now (nothing for the inner step)."""
        self._finish_all()
        return None

    def final_sync(self) -> None:
        """Synchronise now each fragment whose weights may differ from its anchor: every rank
        ends with the anchor, the weights they agree on (a collective call, at the same step on
        every rank, at the end of training, instead of :meth:`flush`).

        A reduction in flight is applied first: sent at this step, the weights become the new
        anchor (nothing was learnt since it was sent); sent earlier, it is merged as at its
        slot. Then a fragment with inner steps since its last synchronisation (or whose weights
        were merged with the anchor since) is synchronised as at its slot, its outer step
        taken, and its weights become the anchor; a fragment that synchronised at this very
        step is left alone (an outer step on a zero outer gradient would still move the anchor
        by the outer momentum). Training may go on afterwards: each fragment's next slot
        averages the steps taken since.
        """
        for f in self.fragments:
            if f.in_flight is not None:
                self._finish(f, merge=f.due - self.overlap_steps != self.position)
        for f in self.fragments:
            if f.synced_at != self.position:
                self._start(f)
                self._finish(f, merge=False)

    def before_layout_change(self) -> None:
        """Apply the reductions in flight: the new layout starts with none."""
        self._finish_all()

    @contextlib.contextmanager
    def true_weights(self) -> Iterator[None]:
        """Inside the block the model holds the anchor (the weights every rank agreed on)."""
        if not self.fragments:
            yield
            return
        with torch.no_grad():
            saved = [[p.detach().clone() for p in f.params] for f in self.fragments]
            for f in self.fragments:
                for p, a in zip(f.params, f.anchors):
                    p.copy_(a.to(p.device))
        try:
            yield
        finally:
            with torch.no_grad():
                for f, ws in zip(self.fragments, saved):
                    for p, w in zip(f.params, ws):
                        p.copy_(w)

    # -- checkpoint, close ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The anchor, the outer optimizers' state, the position in the cycle with each
        reduction in flight (completed, not applied: the resumed run applies it when due),
        and this rank's error-feedback residuals of the outer gradients (its own)."""
        if not self.fragments:
            return dict.fromkeys(self.checkpoint_keys)
        in_flight = {}
        for f in self.fragments:
            if f.in_flight is not None:
                in_flight[str(f.index)] = {"due": f.due, "reduction": f.in_flight.state_dict()}
        return {
            "anchor": [a.detach().to("cpu", copy=True) for a in self.anchor],
            "outer_state": [copy.deepcopy(f.outer.state_dict()) for f in self.fragments],
            "cycle": {
                "position": self.position,
                "fragments": self.num_fragments,
                "sync_every": self.sync_every,
                "members": [list(f.members) for f in self.fragments],
                "in_flight": in_flight,
                "discards": [f.reducer.pending_discards for f in self.fragments],
                "synced_at": [f.synced_at for f in self.fragments],
                "local_skipped_steps": self.local_skipped_steps,
            },
            "outer_residuals": [f.reducer.codec_states() for f in self.fragments],
            "local_state": self._local_state(),
        }

    def _local_state(self) -> dict[str, Any]:
        """This rank's weights of the part and its inner optimizer's state for them."""
        params = self.bucketed.params
        state = self.context.inner.state
        return {
            "weights": [p.detach().to("cpu", copy=True) for p in params],
            "inner": [
                {
                    k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                    for k, v in state.get(p, {}).items()
                }
                for p in params
            ],
        }

    def _load_local_state(self, local: dict[str, Any] | None) -> None:
        """Put back this rank's weights and inner state (the model and the inner optimizer
        were loaded with what every rank saved alike: rank 0's)."""
        if not local:
            return
        params = self.bucketed.params
        weights, inner = local.get("weights") or [], local.get("inner") or []
        _copy_saved(params, weights, "local weights do")
        state = self.context.inner.state
        for p, saved in zip(params, inner):
            if not saved:
                continue
            state[p] = {
                k: (
                    v.to(p.device, dtype=p.dtype, copy=True)
                    if isinstance(v, torch.Tensor) and k != "step" and v.is_floating_point()
                    else v.clone()
                    if isinstance(v, torch.Tensor)
                    else v
                )
                for k, v in saved.items()
            }

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        for f in self.fragments:
            f.in_flight = None
        self._built_for = None
        self.fragments = []
        cycle = state.get("cycle")
        if cycle is None:  # saved before the first step: the first step builds afresh
            return
        if int(cycle["fragments"]) != self.num_fragments or int(cycle["sync_every"]) != (
            self.sync_every
        ):
            raise ValueError(
                f"the checkpoint's local-steps schedule had fragments={cycle['fragments']}, "
                f"sync_every={cycle['sync_every']}; this optimizer has "
                f"fragments={self.num_fragments}, sync_every={self.sync_every}: create it with "
                "the checkpoint's"
            )
        self._saved_members = _saved_members(cycle, len(self.bucketed.params), self.num_fragments)
        fragments = self._ensure_fragments()
        anchors = self.anchor
        saved = state["anchor"]
        _copy_saved(anchors, saved, "anchor does")
        for f, outer in zip(fragments, state["outer_state"]):
            # (torch.distributed.checkpoint stores the state's integer keys as text)
            outer = {**outer, "state": {int(k): v for k, v in outer.get("state", {}).items()}}
            f.outer.load_state_dict(outer)
        residuals = state.get("outer_residuals") or [{}] * len(fragments)
        for f, codec_state, discards in zip(fragments, residuals, cycle["discards"]):
            f.reducer.load_codec_states(codec_state or {})
            f.reducer.pending_discards = int(discards)
        # (absent from an older checkpoint: a final synchronisation then syncs every fragment)
        for f, at in zip(fragments, cycle.get("synced_at") or [-1] * len(fragments)):
            f.synced_at = int(at)
        for key, pending in cycle.get("in_flight", {}).items():  # (DCP drops an empty dict)
            f = fragments[int(key)]
            red = StepReduction(f.reducer, 0, 0, 1.0)
            saved_reduction = dict(pending["reduction"])  # (DCP drops an empty list)
            saved_reduction["result"] = {"bad_buckets": [], **saved_reduction["result"]}
            red.load_state_dict(saved_reduction)
            f.in_flight, f.due = red, int(pending["due"])
        self._load_local_state(state.get("local_state"))
        self.position = int(cycle["position"])
        self.local_skipped_steps = int(cycle.get("local_skipped_steps", 0))

    def close(self) -> None:
        for f in self.fragments:
            if f.in_flight is not None:
                f.in_flight.wait()
                f.in_flight = None


def _copy_saved(tensors: Sequence[torch.Tensor], saved: Sequence[Any], what: str) -> None:
    """Copy a checkpoint's tensors into ``tensors``, refusing a count or shape that differs
    (``what``: the saved tensors' name with its verb, for the message)."""
    if len(saved) != len(tensors) or any(t.shape != s.shape for t, s in zip(tensors, saved)):
        raise ValueError(
            f"the checkpoint's {what} not match this local-steps part's parameters "
            "(a different model or plan?)"
        )
    with torch.no_grad():
        for t, s in zip(tensors, saved):
            t.copy_(s.to(t.device))


def balanced_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Split tensors of ``sizes`` (bytes) into ``fragments`` groups of near-equal bytes.

    Largest first, each tensor joins the group holding the fewest bytes (ties: the fewest
    tensors, then the lower index), so every group gets a tensor when there are enough;
    each group lists its tensors in order, and the groups are numbered by their first
    tensor. A model whose weights and biases alternate splits by bytes, not by position:

    >>> balanced_fragments([4096, 64, 4096, 64], 2)
    [[0, 1], [2, 3]]
    >>> balanced_fragments([48, 8, 24, 3], 2)
    [[0], [1, 2, 3]]
    """
    if fragments < 1:
        return []
    groups: list[list[int]] = [[] for _ in range(fragments)]
    load = [0] * fragments
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        g = min(range(fragments), key=lambda g: (load[g], len(groups[g]), g))
        groups[g].append(i)
        load[g] += int(sizes[i])
    return sorted((sorted(g) for g in groups if g), key=lambda g: g[0])


def _saved_members(cycle: dict[str, Any], count: int, fragments: int) -> list[list[int]]:
    """The checkpoint's split of ``count`` tensors into ``fragments`` (a checkpoint without
    one was saved when tensor ``i`` went to fragment ``i % fragments``)."""
    saved = cycle.get("members")
    if saved is None:
        return [list(range(f, count, fragments)) for f in range(fragments)]
    members = [[int(i) for i in m] for m in saved]
    if len(members) != fragments or sorted(i for m in members for i in m) != list(range(count)):
        raise ValueError(
            f"the checkpoint's split of the local-steps part into fragments ({members}) does "
            f"not fit this part's {count} tensors in {fragments} fragments (a different model "
            "or plan?)"
        )
    return members


def sync_steps(fragment: int, fragments: int, sync_every: int, steps: int) -> Sequence[int]:
    """The inner steps (1-based, up to ``steps``) after which ``fragment`` synchronises (its
    reduction starts ``overlap_steps`` steps before).

    >>> sync_steps(0, 2, 4, 12), sync_steps(1, 2, 4, 12)
    ([2, 6, 10], [4, 8, 12])
    """
    offset = _offset(fragment, fragments, sync_every)
    return [t for t in range(1, steps + 1) if t % sync_every == offset]


def _offset(fragment: int, fragments: int, sync_every: int) -> int:
    """The step of the cycle (mod ``sync_every``) at which ``fragment`` synchronises."""
    return (fragment + 1) * sync_every // fragments % sync_every
