"""A DDP communication hook that runs commopt's codecs and collectives on DDP's own buckets.

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from commopt.integrations.ddp import CommoptHookState, commopt_hook

    model = DDP(net)
    state = CommoptHookState(compression="qsgd4+ef", model=net)
    model.register_comm_hook(state, commopt_hook)
    ...
    torch.save({"model": model.state_dict(), "hook": state.state_dict()}, path)

Each DDP bucket is reduced with the per-layer policy of commopt.codecs (small and 1-D
tensors uncompressed, quantization buckets never straddling two tensors), through
commopt.collectives over DDP's process group: native allreduce for linear codecs,
scatter-reduce/allgather for QSGD, hierarchical across nodes when that applies. The hook
returns at once; the reduction runs on commopt's collective thread, so DDP still overlaps
it with the rest of the backward pass.

The state holds no process group when pickled or saved: ``state_dict()`` is plain tensors
and numbers (error-feedback residuals, the step counter, the seed), and the communicator
is rebuilt lazily from the process group given at construction (or the default group).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.
import copy
import sys
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from commopt import driver
from commopt.codecs import Codec, CompressionPolicy, get_codec
from commopt.reducer import GradientReducer

if TYPE_CHECKING:
    from commopt.comm.torch_dist import TorchCommunicator

__all__ = ["CommoptHookState", "commopt_hook"]


class _GradView:
    """Looks like a parameter to the reducer; its ``grad`` is a view into DDP's bucket."""

    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor):
        self.grad = grad

    shape = property(lambda self: self.grad.shape)
    dtype = property(lambda self: self.grad.dtype)
    device = property(lambda self: self.grad.device)

    def numel(self) -> int:
        return self.grad.numel()

    def is_floating_point(self) -> bool:
        return self.grad.is_floating_point()


class CommoptHookState:
    """Configuration and checkpointable state of :func:`commopt_hook`.

    ``compression``: a codec or its name ("none", "fp16", "bf16", "qsgd4", "qsgd4+ef", ...).
    ``model``: the module wrapped by DDP, to name parameters for the policy's exclusion
    patterns (without it, the policy's size and dimension rules still apply).
    ``process_group``: DDP's group (default: the default group). ``algorithm``: as in
    :func:`commopt.collectives.allreduce`. ``seed``: for stochastic rounding.

    With a LightningModule as ``model``, the first forward under ``Trainer.fit`` raises when
    the Trainer's strategy is one that drops comm hooks (Lightning's DDPStrategy registers
    them on CUDA only): commopt.integrations.lightning.CommoptHookStrategy registers this
    hook on every device.
    """

    def __init__(
        self,
        compression: str | Codec = "fp16",
        *,
        model: torch.nn.Module | None = None,
        process_group=None,
        policy: CompressionPolicy | None = None,
        algorithm: str = "auto",
        seed: int = 0,
    ):
        self.compression = compression
        get_codec(compression)  # a bad name fails here, not inside backward
        self.policy = policy if policy is not None else CompressionPolicy()
        self.process_group = process_group
        self.algorithm = algorithm
        self.seed = int(seed)
        self.reduction = 0  # the reduction number: the codecs' random key
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._comm: TorchCommunicator | None = None
        self._reducers: dict[int, tuple[tuple, GradientReducer]] = {}
        self._pending_codec_state: dict[str, Any] = {}
        # A LightningModule: Lightning's DDPStrategy registers comm hooks on CUDA only and
        # drops them silently elsewhere; the first forward under a Trainer checks.
        lightning = sys.modules.get("lightning.pytorch")
        self._lightning_check = (
            model.register_forward_pre_hook(self._check_lightning_registers)
            if lightning is not None and isinstance(model, lightning.LightningModule)
            else None
        )

    def _check_lightning_registers(self, module: torch.nn.Module, args: Any) -> None:
        """Raise when Lightning's DDPStrategy is training ``module`` on a device where it
        does not register comm hooks (this state's hook would never run)."""
        try:
            trainer: Any = module.trainer  # (a LightningModule: raises while not attached)
        except RuntimeError:
            return
        if trainer is None or trainer.state.fn != "fit":
            return
        handle, self._lightning_check = self._lightning_check, None
        if handle is not None:
            handle.remove()
        strategy = trainer.strategy
        device = getattr(strategy, "root_device", torch.device("cpu"))
        if getattr(strategy, "hook_state", None) is self or device.type == "cuda":
            return
        raise RuntimeError(
            f"Lightning's {type(strategy).__name__} registers DDP communication hooks only on "
            f"CUDA devices: on {device.type} commopt_hook would never run and DDP would "
            "average uncompressed gradients. Use strategy=commopt.integrations.lightning."
            "CommoptHookStrategy(CommoptHookState(...)) (the same hook, on every device) or "
            "commopt.integrations.lightning.CommoptStrategy(compression=...) (commopt's "
            "optimizer: double buffering and compensation too)"
        )

    # -- the communicator, made on first use and never pickled ------------------------
    @property
    def comm(self) -> "TorchCommunicator":
        if self._comm is None:
            from commopt.comm.torch_dist import TorchCommunicator

            self._comm = TorchCommunicator(group=self.process_group)
        return self._comm

    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(
            _comm=None,
            process_group=None,
            _reducers={},
            _names={},
            _pending_codec_state=self.state_dict()["codecs"],
            _lightning_check=None,
        )
        return state

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        codecs = dict(self._pending_codec_state)
        for index, (_, reducer) in self._reducers.items():
            codecs[str(index)] = reducer.codec_states()
        return {"reduction": self.reduction, "seed": self.seed, "codecs": codecs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (saved as "step" before the reduction number had one name)
        self.reduction = int(state["reduction"] if "reduction" in state else state["step"])
        self.seed = int(state["seed"])
        # Residuals are restored into each bucket's reducer when DDP first calls the hook.
        self._pending_codec_state = dict(state.get("codecs", {}))
        for index, (_, reducer) in self._reducers.items():
            if str(index) in self._pending_codec_state:
                reducer.load_codec_states(self._pending_codec_state.pop(str(index)))

    # -- one reducer per DDP bucket ----------------------------------------------------------
    def reducer_for(self, bucket: dist.GradBucket) -> GradientReducer:
        index = bucket.index()
        grads = bucket.gradients()
        params = bucket.parameters()
        signature = tuple((tuple(g.shape), g.dtype) for g in grads)
        cached = self._reducers.get(index)
        if cached is None or cached[0] != signature:
            # DDP rebuilds its buckets once after the first iteration: a new layout gets a
            # new reducer (and starts its error-feedback residuals from zero).
            spec = self.compression
            codec = copy.deepcopy(spec) if isinstance(spec, Codec) else get_codec(spec)
            names = [
                self._names.get(id(p), f"bucket{index}.param{i}") for i, p in enumerate(params)
            ]
            reducer = GradientReducer(
                # duck-typed: the reducer reads only shape, dtype, device, numel() and grad
                self.comm,
                [cast(torch.Tensor, _GradView(g)) for g in grads],
                names,
                codec=None if codec.name in ("none", "fp32") else codec,
                plain_codec=None,
                policy=self.policy,
                bucket_cap_mb=1e9,  # DDP sized the bucket
                algorithm=self.algorithm,
                seed=self.seed,
            )
            if str(index) in self._pending_codec_state:
                reducer.load_codec_states(self._pending_codec_state.pop(str(index)))
            self._reducers[index] = (signature, reducer)
            return reducer
        reducer = cached[1]
        for view, g in zip(reducer.params, grads):
            view.grad = g  # DDP may hand out new views of the same layout
        return reducer


def commopt_hook(
    state: CommoptHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` over DDP's group through commopt's codec."""
    reducer = state.reducer_for(bucket)
    comm = reducer.comm
    # With the bucket's CUDA device named, torch records the current stream when the result
    # is set and makes every consumer's stream wait for it (without: no synchronisation).
    device = bucket.buffer().device
    future: torch.futures.Future = torch.futures.Future(
        devices=[device] if device.type == "cuda" else None
    )
    flats = reducer.buffers[0]
    present = [True] * len(reducer.params)
    for b in reducer.buckets:
        reducer.pack(b, flats[b.index], present)
        reducer.reduce(b, flats[b.index], state.reduction, 1.0)
    step_done = bucket.is_last()

    def finish() -> None:
        try:
            for b in reducer.buckets:
                reducer.unpack(b, flats[b.index], present)
            future.set_result(bucket.buffer())
        except Exception as exc:  # surface transport errors in DDP's backward
            future.set_exception(exc)

    work = driver.then(comm, finish)
    if getattr(comm, "stream_ordered", False):
        work.wait()  # DDP reads the bucket on its current stream: after the unpacking
    if step_done:
        state.reduction += 1
    return future
