"""``create_multi_node_optimizer``: data-parallel training by wrapping any torch optimizer.

The wrapper owns the *when* of gradient reduction: backward hooks that send each bucket as
soon as its gradients are ready, double buffering, the collective NaN/Inf skip and the
state dict. The reducer (commopt/reducer.py) owns the buckets and the codecs; the
collectives own the algorithms.

    >>> import torch, commopt
    >>> comm = commopt.create_communicator("local")
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = commopt.create_multi_node_optimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> opt.step(); opt.zero_grad()
    >>> opt.applied_steps, opt.skipped_steps
    (1, 0)

Modes (see docs/optimizer.md): ``overlap=True`` sends buckets during backward and
``step()`` waits for what is still in flight; ``overlap=False`` sends everything in
``step()``; ``double_buffering=True`` lets the reduction of step t run during step t+1's
forward and backward and applies it at step t+1 (one step stale; ``flush()`` applies the
last one).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from typing import Any, Callable

import torch

from commopt import collectives, driver
from commopt.codecs.base import Codec
from commopt.comm.base import Communicator
from commopt.optim._wrapping import init_hook_tables, inner_attribute
from commopt.reducer import GradientReducer, StepReduction, StepResult

__all__ = ["create_multi_node_optimizer", "MultiNodeOptimizer", "ModelMismatchError"]

log = logging.getLogger("commopt")

STATE_VERSION = 1
#: seconds a collective ``state_dict()`` waits for the other ranks before failing.
STATE_TIMEOUT_ENV = "COMMOPT_STATE_DICT_TIMEOUT"

_CAST_NAMES = {None: "none", torch.float32: "none", torch.float16: "fp16", torch.bfloat16: "bf16"}


class ModelMismatchError(ValueError):
    """The ranks' optimizers (models) do not hold the same parameters."""


def create_multi_node_optimizer(
    optimizer: torch.optim.Optimizer,
    comm: Communicator,
    double_buffering: bool = False,
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
) -> "MultiNodeOptimizer":
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over ``comm``.

    ``allreduce_grad_dtype`` (torch dtype or "float16"/"bfloat16"/"float32"; default: the
    communicator's) is the wire dtype when ``compression`` is None. ``compression`` is a
    Codec or a name for ``commopt.codecs.get_codec`` ("qsgd4", "qsgd4+ef", "fp16"...),
    applied per tensor by ``policy`` (default ``CompressionPolicy()``; the others travel
    in ``allreduce_grad_dtype``). ``model`` (optional) names the parameters in errors and
    has its buffers broadcast from rank 0 with the parameters. ``seed`` keys stochastic
    rounding (default: rank 0's ``torch.initial_seed()``). ``algorithm`` is passed to
    ``commopt.collectives.allreduce``.

    Every rank must create the wrapper, call ``step()``, ``synchronize()``,
    ``add_param_group()``, ``flush()`` and ``state_dict()`` in the same order.
    """
    return MultiNodeOptimizer(
        optimizer, comm, double_buffering=double_buffering, zero_fill=zero_fill,
        allreduce_grad_dtype=allreduce_grad_dtype, compression=compression, overlap=overlap,
        bucket_cap_mb=bucket_cap_mb, policy=policy, model=model, seed=seed, algorithm=algorithm,
    )


def _resolve_codecs(comm, allreduce_grad_dtype, compression, policy):
    """(compressing codec or None, uncompressed codec, policy)."""
    from commopt.codecs import CompressionPolicy, get_codec
    from commopt.comm import parse_dtype

    dtype = parse_dtype(allreduce_grad_dtype) if allreduce_grad_dtype is not None else \
        getattr(comm, "allreduce_grad_dtype", None)
    cast_name = _CAST_NAMES[dtype]
    if compression is None:
        return None, get_codec(cast_name), None
    if not isinstance(compression, (str, Codec)):
        raise TypeError(
            f"compression must be a commopt Codec or a codec name such as 'qsgd4', got "
            f"{type(compression).__name__}"
        )
    codec = get_codec(compression)
    if policy is None:
        policy = CompressionPolicy(uncompressed=cast_name)
    return codec, get_codec(policy.uncompressed), policy


class MultiNodeOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that averages gradients over a communicator.

    Public counters: ``applied_steps``, ``skipped_steps`` (NaN/Inf on some rank: every rank
    skipped the same step), ``last_step_skipped``. See :func:`create_multi_node_optimizer`.
    """

    def __init__(self, optimizer, comm, *, double_buffering=False, zero_fill=True,
                 allreduce_grad_dtype=None, compression=None, overlap=True, bucket_cap_mb=25,
                 policy=None, model=None, seed=None, algorithm="auto"):
        if isinstance(optimizer, MultiNodeOptimizer):
            raise TypeError(
                "this optimizer is already wrapped by create_multi_node_optimizer; wrap the "
                "plain torch optimizer once (use .inner to reach it)"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"create_multi_node_optimizer needs a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}; e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
            )
        if not isinstance(comm, Communicator):
            raise TypeError(
                f"comm must be a commopt Communicator (commopt.create_communicator(...)), got "
                f"{type(comm).__name__}"
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if algorithm not in collectives.ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; one of {collectives.ALGORITHMS}")
        if float(bucket_cap_mb) <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        init_hook_tables(self)
        self._inner = optimizer
        self.comm = comm
        self.double_buffering = bool(double_buffering)
        self.zero_fill = bool(zero_fill)
        self.overlap = bool(overlap)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.algorithm = algorithm
        self.codec, self.plain_codec, self.policy = _resolve_codecs(
            comm, allreduce_grad_dtype, compression, policy)
        self._model_ref = weakref.ref(model) if model is not None else None
        # Counters (saved in state_dict).
        self.applied_steps = 0
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._iteration = 0  # reductions started: the "step" of the RNG keys
        # Reduction state.
        self._reducer: GradientReducer | None = None
        self._hooks: list = []
        self._signature: tuple | None = None
        self._current: StepReduction | None = None  # issued by hooks, not finished
        self._reduced: StepReduction | None = None  # finished and unpacked, not applied
        self._dirty = False  # backward wrote gradients since the last reduction
        self._no_sync = False
        self._internal = 0  # >0 while our own code reads param_groups
        # Double buffering.
        self._pending: StepReduction | None = None  # step t's reduction, applied at t+1
        self._db_buffer = 0
        self._db_exchanged: StepResult | None | bool = False
        seed0 = int(torch.initial_seed()) & (2**63 - 1) if seed is None else int(seed)
        self.seed = int(comm.bcast_obj(seed0, root=0))
        # Gradients travel on a private duplicate of ``comm``: reductions in flight (double
        # buffering keeps one in flight between steps) never interleave with collectives
        # the application, or another wrapper, issues on ``comm`` meanwhile.
        self._data_comm = comm.split(0, comm.rank) if comm.size > 1 else comm
        self._rebuild(broadcast=True)

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
        if (not self.double_buffering and not self._internal
                and (self._dirty or self._current is not None)):
            self.synchronize()
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
        return self.double_buffering

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, like ``torch.optim.Optimizer.zero_grad``.

        ``set_to_none=False`` (with ``zero_fill=True``) makes each ``param.grad`` a zeroed
        view of its bucket: the next backward accumulates straight into the buffer that
        will be sent, and the step copies no gradient in or out (PyTorch DDP's
        ``gradient_as_bucket_view``). The fastest choice for large models; ``None`` grads
        (the default) cost one copy per step and a fresh allocation per backward.
        """
        buffer = self._db_buffer if self.double_buffering else 0
        in_flight = self._current is not None and not self.double_buffering
        if (not set_to_none and self.zero_fill and self._reducer is not None and not in_flight
                and not self._no_sync):
            self._reducer.zero_grads_into(buffer)
            return
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer; a collective call (every rank, same group)."""
        self._drain()
        self._inner.add_param_group(param_group)
        if self._reducer is not None:
            self._rebuild(broadcast=True)

    def __repr__(self) -> str:
        codec = self.codec.name if self.codec is not None else self.plain_codec.name
        return (f"MultiNodeOptimizer({type(self._inner).__name__}, comm={self.comm!r}, codec={codec}, "
                f"double_buffering={self.double_buffering}, overlap={self.overlap}, "
                f"zero_fill={self.zero_fill})")

    def __getstate__(self):
        raise TypeError("a MultiNodeOptimizer holds a communicator and cannot be pickled or "
                        "deep-copied; save opt.state_dict() instead")

    # -- layout: which parameters, in which buckets ------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self._inner.param_groups for p in g["params"]]

    def _names(self, params: list[torch.Tensor]) -> list[str]:
        """The model's parameter names (what the compression policy matches), else positions."""
        model = self._model_ref() if self._model_ref is not None else None
        by_id = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        names, k = [], 0
        for gi, g in enumerate(self._inner.param_groups):
            for pi, _ in enumerate(g["params"]):
                names.append(by_id.get(id(params[k]), f"param_groups[{gi}]['params'][{pi}]"))
                k += 1
        return names

    def _current_signature(self) -> tuple:
        return tuple((id(p), p.requires_grad) for p in self._all_params())

    def _rebuild(self, broadcast: bool) -> None:
        """(Re)build buckets and hooks; check every rank has the same parameters; broadcast."""
        self._internal += 1
        try:
            params = self._all_params()
            names = self._names(params)
            self._check_same_model(params, names)
            if broadcast:
                self._broadcast_from_root(params)
            trainable = [i for i, p in enumerate(params) if p.requires_grad]
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._reducer = GradientReducer(
                self._data_comm, [params[i] for i in trainable], [names[i] for i in trainable],
                codec=self.codec, plain_codec=self.plain_codec, policy=self.policy,
                bucket_cap_mb=self.bucket_cap_mb, algorithm=self.algorithm,
                num_buffers=2 if self.double_buffering else 1, seed=self.seed, grad_views=True,
            )
            me = weakref.ref(self)
            for j, i in enumerate(trainable):
                self._hooks.append(params[i].register_post_accumulate_grad_hook(_GradReady(me, j)))
            self._signature = self._current_signature()
        finally:
            self._internal -= 1

    def _check_same_model(self, params, names) -> None:
        mine = [(names[i], tuple(p.shape), str(p.dtype), bool(p.requires_grad))
                for i, p in enumerate(params)]
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            mine += [(f"buffer {n}", tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()]
        everyone = self.comm.allgather_obj(mine)
        problems = []
        ref = everyone[0]
        for r, theirs in enumerate(everyone[1:], start=1):
            if len(theirs) != len(ref):
                k = next((i for i, (a, b) in enumerate(zip(ref, theirs)) if a != b), min(len(ref), len(theirs)))
                at = ref[k] if k < len(ref) else theirs[k]
                problems.append(f"rank {r} has {len(theirs)} parameters/buffers but rank 0 has "
                                f"{len(ref)}; first difference at {at[0]!r}")
                continue
            for a, b in zip(ref, theirs):
                if a != b:
                    what = "shape" if a[1] != b[1] else "dtype" if a[2] != b[2] else \
                        "requires_grad" if a[3] != b[3] else "name"
                    alias = f" (rank 0 calls it {a[0]!r})" if a[0] != b[0] and what != "name" else ""
                    problems.append(f"rank {r}: parameter {b[0]!r} has {what} "
                                    f"{_field(b, what)} but rank 0 has {_field(a, what)}{alias}")
                    break
        if problems:
            raise ModelMismatchError(
                "the ranks' models differ, so their gradients cannot be averaged: "
                + "; ".join(problems)
                + ". Build the same model on every rank (same architecture and parameter order)."
            )

    @torch.no_grad()
    def _broadcast_from_root(self, params) -> None:
        """Rank 0's parameters (and the model's buffers) to every rank, a few flat messages."""
        tensors = list(params)
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            seen = {id(t) for t in tensors}
            tensors += [t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in seen]
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((str(t.device), t.dtype), []).append(t)
        for group in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self.comm.broadcast(flat, root=0)
            offset = 0
            for t in group:
                n = t.numel()
                t.detach().copy_(flat[offset: offset + n].view_as(t))
                offset += n

    def _ensure_layout(self) -> None:
        """Rebuild when the set of parameters (or their requires_grad) changed."""
        if self._current_signature() != self._signature:
            self._drain()
            self._rebuild(broadcast=True)

    # -- gradient hooks -----------------------------------------------------------------------
    def _on_grad_ready(self, index: int) -> None:
        if self._no_sync:
            return
        self._dirty = True
        if self.double_buffering or not self.overlap:
            return
        if self._current is None:
            self._current = self._start()
        self._current.mark_ready(index)

    def _start(self, scale: float = 1.0, buffer: int = 0) -> StepReduction:
        self._reduced = None
        red = self._reducer.start(step=self._iteration, buffer=buffer, scale=scale)
        self._iteration += 1
        return red

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
        self._internal += 1
        try:
            if self.double_buffering:
                if self._db_exchanged is False:
                    self._ensure_layout()
                    self._db_exchange(scale=1.0)
                return
            if self._reduced is not None and not self._dirty and self._current is None:
                return  # already averaged since the last backward
            self._ensure_layout()
            red = self._current if self._current is not None else self._start()
            self._current = None
            red.finish()
            red.unpack(self.zero_fill)
            self._reduced = red
            self._dirty = False
        finally:
            self._internal -= 1

    def wait(self) -> None:
        """Block until every reduction this optimizer has started is complete.

        Afterwards no gradient of this optimizer is in flight: the averages of every bucket
        sent so far are in their buffers (``step()``/``flush()`` still decide what is
        applied), and an error a reduction met is raised here. Gradients travel on the
        optimizer's private communicator, so waiting on the communicator you passed in
        waits on nothing; call this instead, e.g. before timing or tearing down:

            >>> import torch, commopt
            >>> comm = commopt.create_communicator("local")
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = commopt.create_multi_node_optimizer(
            ...     torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model,
            ...     double_buffering=True)
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> opt.step()   # sends this step's gradients; applies nothing yet
            >>> opt.wait()   # that reduction has completed
            >>> opt.flush(); opt.applied_steps
            1
        """
        driver.drain(self._data_comm)

    _drain = wait  # internal call sites: "nothing of ours in flight" before a layout change

    # -- step -----------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None):
        """Average the gradients over all ranks and apply them with the inner optimizer.

        A step where any rank had NaN/Inf gradients is skipped on every rank (counted in
        ``skipped_steps``). With double buffering the gradients applied are the previous
        step's; the first call applies nothing.
        """
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._internal += 1
        try:
            if self.double_buffering:
                self._step_double_buffered()
            else:
                if self._reduced is None or self._dirty or self._current is not None:
                    self.synchronize()
                red, self._reduced = self._reduced, None
                self._apply(red.wait())
        finally:
            self._internal -= 1
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def _apply(self, result: StepResult | None) -> None:
        """Run the inner step unless some rank had NaN/Inf (decided collectively)."""
        if result is None:
            self.last_step_skipped = False
            return
        if result.nonfinite:
            self.skipped_steps += 1
            self.last_step_skipped = True
            if self.comm.rank == 0:
                log.warning(
                    "commopt: skipped step %d on every rank: NaN/Inf gradients on some rank "
                    "(buckets %s); %d step(s) skipped so far", self.applied_steps + self.skipped_steps,
                    result.bad_buckets, self.skipped_steps)
            return
        self._inner.step()
        self.applied_steps += 1
        self.last_step_skipped = False

    # -- double buffering -------------------------------------------------------------------------
    def _grad_scale(self) -> float:
        """1 / GradScaler's scale when GradScaler drives this step (double buffering)."""
        scale = getattr(self, "grad_scale", None)
        if scale is None:
            return 1.0
        value = float(scale) if not isinstance(scale, torch.Tensor) else float(scale.item())
        return 1.0 / value

    def _db_exchange(self, scale: float) -> None:
        """Send this step's gradients; put the previous step's averages into param.grad."""
        previous = self._pending
        if previous is not None:
            previous.wait()  # its trailer ran on the collectives' thread: no overlap lost
        current = self._start(scale=scale, buffer=self._db_buffer)
        current.finish()  # packs this step's local gradients and sends every bucket
        self._pending = current
        self._db_buffer ^= 1
        if previous is None:
            self._db_exchanged = None  # first step: nothing to apply yet
            return
        if previous.reducer is not self._reducer:
            # The parameters changed: old buckets go to their old parameters; new ones wait.
            covered = {id(p) for p in previous.reducer.params}
            for p in self._reducer.params:
                if id(p) not in covered:
                    p.grad = None
        self._db_exchanged = previous.unpack(self.zero_fill)

    def _step_double_buffered(self) -> None:
        scale = self._grad_scale()
        if self._db_exchanged is False:
            self._ensure_layout()
            self._db_exchange(scale)
        elif scale != 1.0:
            raise RuntimeError(
                "with double_buffering and GradScaler, call scaler.unscale_(optimizer) before "
                "optimizer.synchronize(): the gradients were sent still scaled"
            )
        result, self._db_exchanged = self._db_exchanged, False
        self._apply(result)

    def flush(self) -> None:
        """Apply the last pending gradients (double buffering): call once after training."""
        if not self.double_buffering:
            return  # nothing is ever pending without double buffering
        if self._pending is None:
            return
        self._internal += 1
        try:
            red, self._pending = self._pending, None
            self._apply(red.unpack(self.zero_fill))
            self._db_exchanged = False
        finally:
            self._internal -= 1

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus commopt's under the key ``"commopt"``.

        commopt's part: step counters, the RNG seed, every rank's codec state (error-feedback
        residuals) and, with double buffering, the pending averaged gradients. When the codec
        keeps per-rank state this is a collective call: call it on every rank, save on rank 0.
        """
        self._internal += 1
        try:
            self._drain()
            pending = None
            if self._pending is not None:
                result = self._pending.wait()
                pending = {
                    "step": self._pending.step,
                    "flats": [f.detach().clone().cpu() for f in self._pending.flats],
                    "result": {"nonfinite": result.nonfinite, "bad_buckets": list(result.bad_buckets),
                               "present": list(result.present)},
                }
            codec_states = self._reducer.codec_states()
            if self.comm.size > 1 and any(codec_states.values()):
                everyone = _allgather_with_timeout(self.comm, codec_states)
            else:
                everyone = [codec_states]
            sd = self._inner.state_dict()
            sd["commopt"] = {
                "version": STATE_VERSION,
                "world_size": self.comm.size,
                "seed": self.seed,
                "iteration": self._iteration,
                "applied_steps": self.applied_steps,
                "skipped_steps": self.skipped_steps,
                "double_buffering": self.double_buffering,
                "db_buffer": self._db_buffer,
                "buckets": [b.key for b in self._reducer.buckets],
                "codec_states": everyone,
                "pending": pending,
            }
            return sd
        finally:
            self._internal -= 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state dict from :meth:`state_dict` (or a plain optimizer's)."""
        sd = dict(state_dict)
        extra = sd.pop("commopt", None)
        self._internal += 1
        try:
            self._drain()
            self._inner.load_state_dict(sd)
            if extra is None:
                return
            if extra.get("version") != STATE_VERSION:
                raise ValueError(f"unknown commopt state version {extra.get('version')!r}")
            buckets = [b.key for b in self._reducer.buckets]
            if extra["buckets"] != buckets:
                raise ValueError(
                    "the checkpoint's gradient buckets differ from this optimizer's: load it into "
                    "the same model with the same bucket_cap_mb and compression"
                )
            states = extra["codec_states"]
            if any(states[0].values()) and len(states) != self.comm.size:
                raise ValueError(
                    f"the checkpoint holds codec state (error feedback) of {len(states)} ranks but "
                    f"this job has {self.comm.size}: resume with the same number of ranks"
                )
            self._reducer.load_codec_states(states[self.comm.rank] if len(states) > 1 else states[0])
            self.seed = int(extra["seed"])
            self._reducer.seed = self.seed
            self._iteration = int(extra["iteration"])
            self.applied_steps = int(extra["applied_steps"])
            self.skipped_steps = int(extra["skipped_steps"])
            self._current = self._reduced = None
            self._db_exchanged = False
            pending = extra.get("pending")
            if pending is not None:
                if not self.double_buffering:
                    raise ValueError(
                        "the checkpoint holds pending double-buffered gradients: load it into an "
                        "optimizer with double_buffering=True (or call flush() before saving)"
                    )
                res = pending["result"]
                result = StepResult(bool(res["nonfinite"]), list(res["bad_buckets"]), list(res["present"]))
                self._db_buffer = int(extra["db_buffer"])
                flats = [f.to(b.device) for f, b in zip(pending["flats"], self._reducer.buckets)]
                self._pending = StepReduction.restored(
                    self._reducer, int(pending["step"]), self._db_buffer ^ 1, flats, result)
            else:
                self._pending = None
        finally:
            self._internal -= 1

    # -- misc -------------------------------------------------------------------------------------
    @property
    def buckets(self):
        """The gradient buckets (read-only view, for inspection and tests)."""
        return list(self._reducer.buckets)

    def close(self) -> None:
        """Wait for reductions in flight, detach the hooks, release the private communicator.

        Pending double-buffered gradients are dropped (call ``flush()`` first to apply them).
        """
        self._drain()
        self.remove_hooks()
        self._pending = self._current = self._reduced = None
        if self._data_comm is not self.comm:
            self._data_comm.finalize()

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the wrapper stops sending during backward)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __del__(self):
        try:
            self.remove_hooks()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _GradReady:
    """Backward hook of one parameter; holds the optimizer weakly."""

    def __init__(self, opt_ref, index: int):
        self._opt_ref = opt_ref
        self._index = index

    def __call__(self, param: torch.Tensor) -> None:
        opt = self._opt_ref()
        if opt is not None:
            opt._on_grad_ready(self._index)


def _field(sig, what):
    return {"shape": sig[1], "dtype": sig[2], "requires_grad": sig[3], "name": sig[0]}[what]


def _allgather_with_timeout(comm: Communicator, obj) -> list:
    """``comm.allgather_obj`` that fails, instead of hanging, when a rank never joins."""
    timeout = float(os.environ.get(STATE_TIMEOUT_ENV, "300"))
    box: dict[str, Any] = {}

    def run():
        try:
            box["out"] = comm.allgather_obj(obj)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["err"] = exc

    t = threading.Thread(target=run, name="commopt-state-dict", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise RuntimeError(
            f"rank {comm.rank}: state_dict() waited {timeout:.0f}s for the other ranks. With "
            "error feedback it gathers every rank's residuals: call opt.state_dict() on every "
            f"rank and save it on rank 0 (timeout: ${STATE_TIMEOUT_ENV})"
        )
    if "err" in box:
        raise box["err"]
    return box["out"]

