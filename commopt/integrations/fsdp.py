"""Sharded training on slow links: FSDP2 inside each node, commopt's reduction between nodes.

HSDP shards a model inside a node and replicates it across nodes, so only the replicas'
reduction crosses the slow link. Here FSDP2 (``fully_shard``) shards on the intra-node mesh
and reduce-scatters each unit's gradients inside the node as usual; commopt then averages
each rank's gradient shard with the ranks that hold the same shard on the other nodes,
through its codecs and collectives (fp16, bf16, QSGD 2/4/8, error feedback per shard):

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from commopt.integrations.fsdp import compress_replicas

    mesh = init_device_mesh("cuda", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])      # 1-D: the node's ranks
    fully_shard(model, mesh=mesh["shard"])
    replicas = compress_replicas(model, mesh["replicate"], compression="qsgd4+ef")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for x, y in loader:
        loss_fn(model(x), y).backward()  # reduce-scatter in the node, commopt across nodes
        replicas.step(opt)               # skipped on every rank if some rank saw NaN/Inf
        opt.zero_grad()
    dcp.save({"model": model.state_dict(), "replicas": replicas}, checkpoint_id=path)
    dcp.load({"model": model.state_dict(), "replicas": replicas}, checkpoint_id=path,
             planner=replicas.load_planner())

The seam is ``FSDPModule.set_all_reduce_hook``: FSDP2 calls the hook of each unit with the
unit's flat reduce-scatter output (already divided by FSDP's own factor), then divides by
its post-factor if any, casts to the parameters' dtype and makes the slices the sharded
gradients. The hook averages that flat shard over the replicas (divides by their number), so
the gradient is the mean over all ranks whatever divide factors FSDP applied; a custom
factor is given here (``gradient_divide_factor=``), never set on the modules directly.

Overlap. On a stream-ordered transport (torch with nccl, pure_nccl) the hook only enqueues:
FSDP runs it on its all-reduce stream (or ``stream=``) and orders its own later work after
it. On host-ordered transports (gloo, mpi) the hook packs the shard, hands the reduction to
commopt's worker thread and returns, so backward goes on while the shard crosses the link;
the averages are written back into the gradient shard (whose memory is the hook's tensor)
and ``backward()`` returns once all are in. This needs FSDP to leave the hook's tensor as
the gradient: it checks that on each unit's first reduction (which waits in the hook) and
keeps waiting in the hook for a unit where it does not hold (a reduce dtype other than the
parameters', a post-divide factor, CPU offload, or a gradient accumulated onto an existing
one), said once in the log.

State. Error-feedback residuals belong to each rank's shard and are saved per rank through
``torch.distributed.checkpoint`` next to the model's sharded state (``replicas`` is a DCP
``Stateful``); ``load_planner()`` lets DCP allocate them on load. A checkpoint saved with
another layout (number of nodes or of shards, codec or model) resumes with the residuals
reset, said in the log: each residual is the error of one node's encoding of one shard's
chunks, which another layout cuts differently; dropping it loses at most the error of one
reduction, whereas refusing would stop a resize that FSDP's own state supports.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from commopt import driver, kernels
from commopt.codecs import Codec, CompressionPolicy, ErrorFeedback, PowerSGD, get_codec
from commopt.comm.base import Communicator, Work
from commopt.optim.fingerprint import SettingsMismatchError
from commopt.reducer import GradientReducer
from commopt.reducer.agreement import may_overflow

if TYPE_CHECKING:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

__all__ = ["CompressedReplicas", "compress_replicas", "model_parallel_strategy"]

log = logging.getLogger("commopt")

#: Version of :meth:`CompressedReplicas.state_dict`'s format.
STATE_VERSION = 1
_SEP = "|"  # joins a residual's rank, unit, codec kind, field and key in its DCP name


def compress_replicas(
    model: torch.nn.Module,
    replicas,
    compression: str | Codec = "qsgd4+ef",
    *,
    policy: CompressionPolicy | None = None,
    algorithm: str = "auto",
    seed: int = 0,
    overlap: bool = True,
    gradient_divide_factor: float | None = None,
    check_nonfinite: bool = True,
    timeout: float | str | None = None,
    stream=None,
) -> CompressedReplicas:
    """Average every FSDP2 unit's gradient shard over the model's replicas through commopt.

    ``model``: wrapped with ``fully_shard`` on a 1-D mesh of one node's ranks (each unit and
    the root). ``replicas``: the ranks holding the same shard on the other nodes, as a 1-D
    DeviceMesh (``mesh["replicate"]``), a ProcessGroup or a commopt Communicator.
    ``compression``: a codec or its name ("fp32", "fp16", "bf16", "qsgd2", "qsgd4",
    "qsgd8", each also with "+ef"); ``policy`` picks the tensors it compresses (default:
    2-D shards of at least its minimum size; biases and norms travel in fp32).
    ``algorithm``: as in :func:`commopt.collectives.allreduce`. ``seed``: stochastic
    rounding. ``overlap``: on host-ordered transports, reduce while backward goes on (see
    the module's text). ``gradient_divide_factor``: the sum over all ranks is divided by it
    instead of averaged (FSDP's ``set_gradient_divide_factor`` meaning, for the whole job).
    ``check_nonfinite``: agree on NaN/Inf over every rank each backward (two one-element
    collectives). ``timeout``: seconds a collective may go without progress, for a
    communicator made here (default $COMMOPT_COMM_TIMEOUT or 600). ``stream``: the CUDA
    stream FSDP runs the hook on (default: FSDP's own all-reduce stream).

    A collective call: every rank of the job calls it, with the same settings.
    """
    return CompressedReplicas(
        model,
        replicas,
        compression,
        policy=policy,
        algorithm=algorithm,
        seed=seed,
        overlap=overlap,
        gradient_divide_factor=gradient_divide_factor,
        check_nonfinite=check_nonfinite,
        timeout=timeout,
        stream=stream,
    )


@dataclass(frozen=True)
class _Segment:
    """One parameter's part of a unit's flat reduce-scatter output, on this rank."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


def _stretch(bucket, segments: list[_Segment]) -> int | None:
    """Where ``bucket`` starts in the hook's flat tensor if it is one stretch of it (its
    slots in the same order and places, no padding), else None.

        >>> from commopt.reducer.layout import Bucket, Slot
        >>> segs = [_Segment("w", 0, 8, (2, 4)), _Segment("b", 8, 2, (2,))]
        >>> b = Bucket(0, None, False, torch.device("cpu"), torch.float32, [Slot(1, 0, 2, 2)], 2)
        >>> _stretch(b, segs)
        8
        >>> b.slots, b.numel = [Slot(1, 0, 2, 2), Slot(0, 2, 8, 8)], 10  # reversed order
        >>> _stretch(b, segs) is None
        True
    """
    start = None
    for s in bucket.slots:
        at = segments[s.param].offset - s.offset
        if s.padded != s.numel or at < 0 or (start is not None and at != start):
            return None
        start = at
    return start


class _ShardView:
    """Looks like a parameter to the reducer; its ``grad`` is a view into the hook's tensor."""

    __slots__ = ("device", "dtype", "grad", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = device
        self.grad: torch.Tensor | None = None

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


class _Unit:
    """One FSDP unit: its parameters, its part of the flat shard, its reducer and mode."""

    def __init__(self, index: int, name: str, module, params: list, segments: list[_Segment]):
        self.index = index
        self.name = name
        self.module = module
        self.params = params
        self.segments = segments
        self.numel = sum(s.numel for s in segments)
        self.reducer: GradientReducer | None = None
        # Per bucket of the reducer: where its flat buffer starts in the hook's tensor when
        # the bucket is one stretch of it (reduced there, no copy in or out), else None.
        self.in_place: list[int | None] = []
        self.flats: list[torch.Tensor] = []  # the buckets' flat buffers, this backward
        self.pending_state: dict[str, Any] = {}  # codec state for the reducer, once made
        # "probe": wait in the hook and check FSDP's handling afterwards; then "deferred"
        # (reduce while backward goes on) or "blocking" (wait in the hook).
        self.mode = "probe"
        self.output: torch.Tensor | None = None  # the hook's tensor, this backward
        self.expected: torch.Tensor | None = None  # probe: the averages written into it
        self.bad: list[Any] = []  # per bucket: the local NaN/Inf flag of its packing
        self.work: Work | None = None  # deferred: the unpacking still in flight

    def describe(self) -> str:
        return (
            f"{self.name or '<root>'}:{self.numel}["
            + ",".join(f"{s.name}{list(s.shape)}" for s in self.segments)
            + "]"
        )


class CompressedReplicas:
    """The replicas' reduction of an FSDP2 model (made by :func:`compress_replicas`).

    ``step(optimizer)`` applies a step unless the last backward held NaN/Inf on some rank;
    ``nonfinite`` says so; ``applied_steps``/``skipped_steps`` count; ``state_dict()`` /
    ``load_state_dict()`` / ``load_planner()`` checkpoint it with DCP (``save(path)`` /
    ``load(path)`` do so on their own); ``close()`` removes the hooks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        replicas,
        compression: str | Codec = "qsgd4+ef",
        *,
        policy: CompressionPolicy | None = None,
        algorithm: str = "auto",
        seed: int = 0,
        overlap: bool = True,
        gradient_divide_factor: float | None = None,
        check_nonfinite: bool = True,
        timeout: float | str | None = None,
        stream=None,
    ):
        from commopt import collectives

        self.codec = _check_codec(compression)
        self.policy = policy if policy is not None else CompressionPolicy()
        if algorithm not in collectives.ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; one of {collectives.ALGORITHMS}")
        self.algorithm = algorithm
        self.seed = int(seed)
        self.overlap = bool(overlap)
        self.check_nonfinite = bool(check_nonfinite)
        if gradient_divide_factor is not None and not float(gradient_divide_factor) > 0:
            raise ValueError(
                f"gradient_divide_factor must be a positive number, got {gradient_divide_factor}"
            )
        self.gradient_divide_factor = gradient_divide_factor
        self.comm = _replicas_communicator(replicas, timeout)
        units, shard_mesh = _find_units(model)
        self._shard_group = shard_mesh.get_group()
        self.shard_rank, self.shards = shard_mesh.get_local_rank(), shard_mesh.size()
        self.replica_rank, self.replica_count = self.comm.rank, self.comm.size
        self.units = units
        self.layout = self._layout_text()
        self._check_settings()
        self.step_number = 0  # the reduction number: keys the codecs' random numbers
        self.applied_steps = 0
        self.skipped_steps = 0
        self._in_backward = False
        self._called: list[_Unit] = []
        self._number = 0
        self._unsettled: tuple[list[_Unit], Any] | None = None
        self._nonfinite = False
        self._template: dict[str, Any] | None = None  # the last state_dict() handed out
        self._planned: dict[str, Any] | None = None  # ... and the one load_planner() filled
        self._logged_blocking: set[str] = set()
        if gradient_divide_factor is not None:
            # FSDP divides by factor / replicas inside the node; the hook by the replicas.
            for unit in units:
                unit.module.set_gradient_divide_factor(
                    float(gradient_divide_factor) / self.replica_count
                )
        # The hooks hold this object: the model keeps it for as long as it is hooked.
        for unit in units:
            unit.module.set_all_reduce_hook(_Hook(self, unit), stream=stream)

    # -- set-up ----------------------------------------------------------------------------
    def _layout_text(self) -> str:
        """What a checkpoint's residuals depend on: replicas, shards, codec, units."""
        return (
            f"replicas={self.replica_count} shards={self.shards} codec={self.codec!r} "
            f"policy={self.policy!r} units=" + ";".join(u.describe() for u in self.units)
        )

    @property
    def _rank_key(self) -> str:
        return f"replica{self.replica_rank}of{self.replica_count}_shard{self.shard_rank}of{self.shards}"

    def _check_settings(self) -> None:
        """Every replica must hold the same shard, with the same settings and units."""
        if self.comm.size == 1:
            return
        mine = {
            "shard": f"{self.shard_rank} of {self.shards}",
            "compression": repr(self.codec),
            "policy": repr(self.policy),
            "algorithm": self.algorithm,
            "gradient_divide_factor": repr(self.gradient_divide_factor),
            "check_nonfinite": repr(self.check_nonfinite),
            "units": self.layout.split(" units=", 1)[1],
        }
        everyone = self.comm.allgather_obj(mine)
        problems = []
        for name in mine:
            sides: dict[str, list[int]] = {}
            for r, theirs in enumerate(everyone):
                sides.setdefault(str(theirs.get(name)), []).append(r)
            if len(sides) > 1:
                text = "; ".join(f"replicas {rs}: {_short(v)}" for v, rs in sides.items())
                problems.append(f"{name} differs ({text})")
        if problems:
            hint = (
                "the replicas must be the ranks that hold the same shard on each node: pass "
                "mesh['replicate'] of a ('replicate', 'shard') mesh whose 'shard' dimension "
                "fully_shard used"
                if problems[0].startswith("shard ")
                else "pass the same compression, policy, algorithm, gradient_divide_factor "
                "and check_nonfinite on every rank, and shard the same model the same way"
            )
            raise SettingsMismatchError(
                f"replica {self.comm.rank}: compress_replicas was called with settings that "
                f"would not meet on the wire: {'; '.join(problems)}. Fix: {hint}"
            )

    # -- the reduction, from the hooks --------------------------------------------------------
    def reduce_unit(self, unit: _Unit, output: torch.Tensor) -> None:
        """FSDP's all-reduce hook of ``unit``: average ``output`` over the replicas, in place."""
        if output.numel() != unit.numel:
            raise RuntimeError(
                f"commopt: FSDP unit {unit.name or '<root>'!r} reduced {output.numel()} "
                f"elements per rank but its parameters make {unit.numel}: some parameter had "
                "no gradient on this rank, and FSDP reduces only those that have one. Call "
                "module.set_reduce_scatter_unused_params(True) on the model (FSDP then sends "
                "zeros for them), or freeze the unused parameters on every rank"
            )
        if not self._in_backward:
            self._begin_backward()
        self._called.append(unit)
        reducer = self._reducer(unit, output)
        for view, seg in zip(reducer.params, unit.segments):
            view.grad = output[seg.offset : seg.offset + seg.numel].view(seg.shape)
        reduction = reducer.start(self._number)  # opens the codecs' step (error feedback)
        # A bucket that is one stretch of the hook's tensor is reduced where it lies: packing
        # then only checks it for NaN/Inf, and the averages need no unpacking.
        flats = [
            reducer.buffers[0][b.index] if at is None else output[at : at + b.numel]
            for b, at in zip(reducer.buckets, unit.in_place)
        ]
        unit.flats = flats
        present = [True] * len(unit.segments)
        unit.bad = [reducer.pack(b, flats[b.index], present) for b in reducer.buckets]
        for b in reducer.buckets:
            reducer.reduce(b, flats[b.index], reduction.number, 1.0)
        keep = [True] * len(unit.segments)
        copied = [b for b, at in zip(reducer.buckets, unit.in_place) if at is None]

        def unpack() -> None:
            for b in copied:
                reducer.unpack(b, flats[b.index], keep)

        unit.output = output
        cuda = output.device if output.device.type == "cuda" else None
        work = driver.then(self.comm, unpack, device=cuda)  # (ordered with this stream)
        if self.comm.stream_ordered:
            work.wait()  # FSDP's next kernels on this stream run after the unpacking
            return
        if (
            unit.mode == "deferred"
            and self.overlap
            and output.device.type == "cpu"
            and all(p.grad is None for p in unit.params)  # FSDP will not accumulate
        ):
            unit.work = work  # backward goes on; end of backward waits for it
            return
        work.wait()
        if unit.mode == "probe":
            unit.expected = output.clone()

    def _reducer(self, unit: _Unit, output: torch.Tensor) -> GradientReducer:
        reducer = unit.reducer
        if (
            reducer is not None
            and reducer.params[0].dtype == output.dtype
            and reducer.params[0].device == output.device
        ):
            return reducer
        spec = self.codec
        codec = copy.deepcopy(spec)
        reducer = GradientReducer(
            self.comm,
            [
                _ShardView(s.shape, output.dtype, output.device)  # type: ignore[misc]
                for s in unit.segments
            ],
            [s.name for s in unit.segments],
            codec=None if codec.name in ("none", "fp32") else codec,
            plain_codec=_plain_codec(self.policy),
            policy=self.policy,
            bucket_cap_mb=2**30,  # one bucket of each kind per unit
            algorithm=self.algorithm,
            # Apart per unit and per shard: the replicas of a shard differ by their rank.
            seed=self.seed + (unit.index << 24) + (self.shard_rank << 44),
        )
        if unit.pending_state:
            reducer.load_codec_states(unit.pending_state)
            unit.pending_state = {}
        unit.reducer = reducer
        unit.in_place = [
            _stretch(b, unit.segments) if b.dtype == output.dtype else None for b in reducer.buckets
        ]
        return reducer

    def _begin_backward(self) -> None:
        self._settle()
        self._in_backward = True
        self._called = []
        self._number = self.step_number
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """Autograd's final callback: every unit's averages are in, then the agreement."""
        self._in_backward = False
        called = self._called
        try:
            deferred = [unit for unit in called if unit.work is not None]
            for unit in deferred:
                work, unit.work = unit.work, None
                if work is not None:
                    work.wait()
            for unit in called:
                if unit.mode == "probe" and not self.comm.stream_ordered:
                    self._probe(unit)
            for unit in deferred:
                if not self._aliased(unit):
                    raise RuntimeError(
                        f"commopt: the sharded gradients of FSDP unit {unit.name!r} stopped "
                        "being the memory the replicas' average was written into (a changed "
                        "reduce dtype, divide factor or offload policy?): this step's "
                        "gradients are not averaged across nodes. Pass overlap=False to "
                        "compress_replicas"
                    )
            flag = self._agree(called) if self.check_nonfinite else None
            self._unsettled = (called, flag)
            if flag is not None:
                self._mark_nonfinite(called, flag)
            if not isinstance(flag, torch.Tensor):
                self._settle()  # known on the host already
        finally:
            for unit in called:
                unit.output = None
                unit.expected = None
                unit.flats = []

    def _probe(self, unit: _Unit) -> None:
        """After a unit's first reduction: does FSDP keep the hook's tensor as the gradient?"""
        why = None
        if not self._aliased(unit):
            why = (
                "its sharded gradients are not the hook's tensor (a reduce dtype other than "
                "the parameters', CPU offload or an accumulated gradient)"
            )
        elif (
            unit.output is not None
            and unit.expected is not None
            and not _same_bits(unit.output, unit.expected)
        ):
            why = "FSDP changes the hook's tensor afterwards (a post-divide factor)"
        unit.mode = "deferred" if why is None else "blocking"
        if why is not None and self.overlap and unit.name not in self._logged_blocking:
            self._logged_blocking.add(unit.name)
            log.info(
                "commopt: FSDP unit %r waits for the replicas' average in the hook: %s",
                unit.name,
                why,
            )

    def _aliased(self, unit: _Unit) -> bool:
        out = unit.output
        if out is None:
            return False
        for p, seg in zip(unit.params, unit.segments):
            g = p.grad
            if g is None:
                return False
            local = g.to_local()
            if local.numel() and local.data_ptr() != out[seg.offset :].data_ptr():
                return False
        return True

    def _agree(self, called: list[_Unit]):
        """One flag over every rank: did some unit hold NaN/Inf anywhere this backward?"""
        comm = self.comm
        device = called[0].output.device if called and called[0].output is not None else None
        result: list[torch.Tensor] = []

        def local_flags() -> None:
            if comm.stream_ordered:
                flags = torch.zeros(1, device=device)
                for unit in called:
                    assert unit.reducer is not None
                    flats = unit.flats
                    for b, bad in zip(unit.reducer.buckets, unit.bad):
                        if isinstance(bad, torch.Tensor):
                            flags.add_(bad.reshape(1).to(torch.float32))
                        elif bad:
                            flags.fill_(1.0)
                        if may_overflow(b.codec, 1.0):
                            flags.add_((~torch.isfinite(flats[b.index]).all()).reshape(1))
            else:
                bad_here = any(
                    bool(bad) or (may_overflow(b.codec, 1.0) and kernels.any_nonfinite((flat,)))
                    for unit in called
                    if unit.reducer is not None
                    for b, bad, flat in zip(unit.reducer.buckets, unit.bad, unit.flats)
                )
                flags = torch.tensor([float(bad_here)], device=device)
            comm.allreduce(flags)
            result.append(flags)

        driver.then(
            comm, local_flags, device=device if device and device.type == "cuda" else None
        ).wait()
        flags = result[0]
        if self.shards > 1:
            dist.all_reduce(flags, group=self._shard_group)
        if comm.stream_ordered:
            return flags  # read at step(): no host wait here
        return bool(flags.item() > 0)

    def _mark_nonfinite(self, called: list[_Unit], flag) -> None:
        """Every rank's gradients of a step that held NaN/Inf somewhere become NaN."""
        grads = [p.grad.to_local() for unit in called for p in unit.params if p.grad is not None]
        if isinstance(flag, torch.Tensor):  # on the device: NaN where bad, -0.0 (no change) else
            mark = torch.where(flag > 0, float("nan"), -0.0)
            for g in grads:
                g.add_(mark.to(g.dtype))
        elif flag:
            for g in grads:
                g.fill_(float("nan"))

    def _settle(self) -> None:
        """Take the last backward's agreement: skip (undo the codecs' step) or count it."""
        if self._unsettled is None:
            return
        called, flag = self._unsettled
        self._unsettled = None
        bad = bool(flag.item() > 0) if isinstance(flag, torch.Tensor) else bool(flag)
        self._nonfinite = bad
        if bad:
            for unit in called:
                if unit.reducer is not None:
                    unit.reducer.discard_step()
                    unit.reducer.pending_discards = 0  # the number is given back here
        else:
            self.step_number += 1

    # -- the step --------------------------------------------------------------------------------
    @property
    def nonfinite(self) -> bool:
        """Whether the last backward held NaN/Inf on some rank (the same answer everywhere)."""
        self._settle()
        return self._nonfinite

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs) -> bool:
        """``optimizer.step()`` unless the last backward held NaN/Inf on some rank; whether applied."""
        if self.nonfinite:
            self.skipped_steps += 1
            return False
        optimizer.step(*args, **kwargs)
        self.applied_steps += 1
        return True

    def wire_bytes(self) -> int:
        """Bytes this rank hands to the replicas' collectives per reduction: each unit's
        buckets as their codec encodes them (float32 where none); 0 before the first."""
        total = 0
        for unit in self.units:
            if unit.reducer is None:
                continue
            for b in unit.reducer.buckets:
                total += b.codec.encoded_nbytes(b.numel) if b.codec is not None else 4 * b.numel
        return total

    def wait(self) -> None:
        """Wait for every reduction in flight (none remain once ``backward()`` returned)."""
        driver.drain(self.comm)

    def close(self) -> None:
        """Remove the hooks: FSDP's gradients stay local to each node from then on."""
        for unit in self.units:
            unit.module.set_all_reduce_hook(_no_hook)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, for ``torch.distributed.checkpoint`` beside the model's.

        ``step``, the counters and ``layout`` are the same on every rank; ``residuals`` holds
        this rank's error-feedback residuals under names of its own (replica and shard), so
        every rank's are saved and each rank reads back its own.
        """
        self._settle()
        self.wait()
        residuals: dict[str, torch.Tensor] = {}
        for unit in self.units:
            states = unit.reducer.codec_states() if unit.reducer is not None else unit.pending_state
            for kind, state in states.items():
                for field, entries in state.items():
                    for key, tensor in entries.items():
                        name = _SEP.join((self._rank_key, str(unit.index), kind, field, str(key)))
                        residuals[name] = tensor
        state = {
            "version": STATE_VERSION,
            "step": self.step_number,
            "applied_steps": self.applied_steps,
            "skipped_steps": self.skipped_steps,
            "layout": self.layout,
            "residuals": residuals,
        }
        self._template = state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (read back through DCP or as it was)."""
        version = int(state.get("version", -1))
        if version != STATE_VERSION:
            raise ValueError(
                f"commopt: replicas state of version {version}; this commopt reads "
                f"version {STATE_VERSION}"
            )
        self._settle()
        self.wait()
        self.step_number = int(state["step"])
        self.applied_steps = int(state.get("applied_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        residuals = state.get("residuals") or {}
        saved_layout = str(state["layout"])
        per_unit: dict[int, dict[str, Any]] = {}
        if saved_layout != self.layout:
            log.warning(
                "commopt: the replicas' error-feedback residuals restart at zero: the "
                "checkpoint was saved with %s, this job runs %s (each residual belongs to "
                "one node's encoding of one shard's chunks)",
                _short(saved_layout, 200),
                _short(self.layout, 200),
            )
        else:
            if (
                not residuals
                and isinstance(self.codec, ErrorFeedback)
                and self.step_number > 0
                and state is self._template
                and self._planned is not state
            ):
                raise ValueError(
                    "commopt: the replicas' error-feedback residuals were not read: "
                    "torch.distributed.checkpoint loads only the tensors its template "
                    "holds, and a job that has not reduced yet holds none. Load with "
                    "dcp.load(..., planner=replicas.load_planner()) (or replicas.load(path))"
                )
            prefix = self._rank_key + _SEP
            for name, tensor in residuals.items():
                if not name.startswith(prefix):
                    continue
                unit, kind, field, key = name[len(prefix) :].split(_SEP, 3)
                entries = per_unit.setdefault(int(unit), {}).setdefault(kind, {})
                entries.setdefault(field, {})[key] = tensor
        for unit in self.units:
            unit.reducer = None  # made afresh at the next reduction, with this state
            unit.pending_state = per_unit.get(unit.index, {})
        self._template = self._planned = None

    def load_planner(self, **kwargs) -> DefaultLoadPlanner:
        """A DCP load planner (``DefaultLoadPlanner(**kwargs)``) that also reads this rank's
        residuals: a fresh job holds none yet, so it allocates them from the checkpoint."""
        return _make_load_planner(self, **kwargs)

    def save(self, checkpoint_id) -> None:
        """``dcp.save`` of this state alone (beside a framework's own checkpoint)."""
        import torch.distributed.checkpoint as dcp

        dcp.save({"commopt_replicas": self}, checkpoint_id=checkpoint_id)

    def load(self, checkpoint_id) -> None:
        """``dcp.load`` of what :meth:`save` wrote."""
        import torch.distributed.checkpoint as dcp

        dcp.load(
            {"commopt_replicas": self},
            checkpoint_id=checkpoint_id,
            planner=self.load_planner(),
        )

    # For the planner: fill the template handed out last with this rank's saved residuals.
    def fill_load_template(self, state_dict: dict[str, Any], metadata) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        path = _find(state_dict, self._template)
        if path is None or metadata is None or self._template is None:
            return
        prefix = ".".join([*path, "residuals", ""])
        mine = prefix + self._rank_key + _SEP
        self._template["residuals"] = {
            fqn[len(prefix) :]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items()
            if fqn.startswith(mine) and isinstance(md, TensorStorageMetadata)
        }
        self._planned = self._template


def model_parallel_strategy(**kwargs):
    """Lightning's ``ModelParallelStrategy(**kwargs)`` that also checkpoints the replicas.

    The LightningModule makes its :class:`CompressedReplicas` in ``configure_model`` and keeps
    it as an attribute; each checkpoint Lightning writes then carries every rank's residuals
    (``<checkpoint>/commopt-replicas``, or ``<checkpoint>.commopt-replicas`` for a single-file
    one), and ``ckpt_path=`` restores them. Lightning's own strategy saves only the model and
    the optimizers through DCP and the rest from rank 0.
    """
    from pathlib import Path

    from lightning.pytorch.strategies import ModelParallelStrategy

    def replicas_of(module) -> list[CompressedReplicas]:
        return [v for v in vars(module).values() if isinstance(v, CompressedReplicas)]

    def part(path: Path, index: int) -> str:
        name = "commopt-replicas" + (f"-{index}" if index else "")
        return str(path / name) if path.is_dir() else f"{path}.{name}"

    class CommoptModelParallelStrategy(ModelParallelStrategy):
        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            path = Path(self.broadcast(filepath))
            for i, replicas in enumerate(replicas_of(self.lightning_module)):
                replicas.save(part(path, i))

        def load_checkpoint(self, checkpoint_path, weights_only=None):
            out = super().load_checkpoint(checkpoint_path, weights_only)
            path = Path(self.broadcast(checkpoint_path))
            for i, replicas in enumerate(replicas_of(self.lightning_module)):
                replicas.load(part(path, i))
            return out

    return CommoptModelParallelStrategy(**kwargs)


class _Hook:
    """FSDP's all-reduce hook of one unit."""

    def __init__(self, owner: CompressedReplicas, unit: _Unit):
        self._owner = owner
        self._unit = unit

    def __call__(self, output: torch.Tensor) -> None:
        self._owner.reduce_unit(self._unit, output)


def _no_hook(output: torch.Tensor) -> None:
    """The hook left by ``close()``: FSDP's reduce-scatter output stays as it is."""


def _make_load_planner(owner: CompressedReplicas, **kwargs):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class ReplicasLoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            owner.fill_load_template(state_dict, metadata)
            super().set_up_planner(state_dict, metadata, is_coordinator)

    return ReplicasLoadPlanner(**kwargs)


def _find(tree: dict[str, Any], target, depth: int = 4) -> list[str] | None:
    """The key path to ``target`` (by identity) in nested dicts, or None."""
    if target is None:
        return None
    for key, value in tree.items():
        if value is target:
            return [str(key)]
        if isinstance(value, dict) and depth > 0:
            sub = _find(value, target, depth - 1)
            if sub is not None:
                return [str(key), *sub]
    return None


def _check_codec(compression: str | Codec) -> Codec:
    if not isinstance(compression, (str, Codec)):
        raise TypeError(
            f"compression must be a commopt Codec or a codec name such as 'qsgd4+ef', got "
            f"{type(compression).__name__}"
        )
    codec = get_codec(compression)
    if isinstance(codec, PowerSGD):
        raise ValueError(
            f"compression={codec.name!r}: the low-rank codec factors whole matrices, and a "
            "rank holds rows of them; use fp16, bf16 or qsgd2/4/8 (+ef) across the replicas"
        )
    return codec


def _plain_codec(policy: CompressionPolicy) -> Codec | None:
    return None if policy.uncompressed in ("none", "fp32") else get_codec(policy.uncompressed)


def _replicas_communicator(replicas, timeout) -> Communicator:
    if isinstance(replicas, Communicator):
        return replicas
    from torch.distributed.device_mesh import DeviceMesh

    from commopt.comm.torch_dist import TorchCommunicator

    if isinstance(replicas, DeviceMesh):
        if replicas.ndim != 1:
            raise ValueError(
                f"replicas must be a 1-D DeviceMesh (e.g. mesh['replicate']), got one of "
                f"{replicas.ndim} dimensions"
            )
        replicas = replicas.get_group()
    if not isinstance(replicas, dist.ProcessGroup):
        raise TypeError(
            "replicas must be a 1-D DeviceMesh (mesh['replicate']), a torch ProcessGroup or "
            f"a commopt Communicator, got {type(replicas).__name__}"
        )
    return TorchCommunicator(group=replicas, timeout=timeout)


def _find_units(model: torch.nn.Module):
    """The FSDP units of ``model`` with their parameters in FSDP's order, and their mesh."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    modules = {id(m): n for n, m in model.named_modules()}
    units: list[_Unit] = []
    mesh = None
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        params = [
            p
            for p in _managed_params(module, FSDPModule)
            if isinstance(p, DTensor) and p.requires_grad
        ]
        if not params:
            continue
        segments: list[_Segment] = []
        offset = 0
        for p in params:
            pmesh = p.device_mesh
            if pmesh.ndim != 1:
                raise ValueError(
                    f"commopt: parameter {names.get(id(p), '?')!r} is sharded on a "
                    f"{pmesh.ndim}-D mesh: FSDP2's native HSDP all-reduces the replicas itself "
                    "(commopt sees only its result). Shard with fully_shard(module, "
                    "mesh=mesh['shard']) and pass mesh['replicate'] to compress_replicas"
                )
            if mesh is None:
                mesh = pmesh
            elif pmesh != mesh:
                raise ValueError(
                    "commopt: the model's FSDP units are sharded on different meshes; "
                    "compress_replicas needs one intra-node mesh for the whole model"
                )
            placement = p.placements[0]
            shards = pmesh.size()
            if isinstance(placement, Shard) and placement.dim != 0:
                shape = tuple(p.to_local().shape)  # FSDP needs even sharding off dim 0
            else:
                rows = -(-p.shape[0] // shards)
                shape = (rows, *p.shape[1:])
            numel = math.prod(shape)
            segments.append(
                _Segment(names.get(id(p), f"param{len(segments)}"), offset, numel, shape)
            )
            offset += numel
        units.append(_Unit(len(units), modules.get(id(module), ""), module, params, segments))
    if mesh is None:
        raise ValueError(
            "commopt: the model has no parameters sharded by FSDP2: apply "
            "torch.distributed.fsdp.fully_shard(module, mesh=mesh['shard']) to its blocks and "
            "to the model before compress_replicas"
        )
    return units, mesh


def _managed_params(unit, fsdp_type) -> list:
    """The parameters FSDP manages in ``unit``, in its order: modules in post-order, not
    entering nested units, each module's own parameters, each parameter once."""
    order: list[torch.nn.Module] = []
    seen: set[int] = set()

    def visit(module: torch.nn.Module) -> None:
        if module is not unit and isinstance(module, fsdp_type):
            return
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                visit(child)
        order.append(module)

    visit(unit)
    params: list = []
    ids: set[int] = set()
    for module in order:
        for p in module.parameters(recurse=False):
            if id(p) not in ids:
                ids.add(id(p))
                params.append(p)
    return params


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN equal to NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
