"""``commopt``: a torch.distributed backend that compresses DDP's gradient allreduce.

Plain DDP scripts change one word, the backend name; the codec comes from the environment:

    import commopt.integrations.backend          # registers the backend "commopt"
    dist.init_process_group("commopt")           # instead of "gloo" or "nccl"
    model = DDP(model)                           # unchanged: its buckets travel compressed

or, leaving even the import out, launch through this module:
``torchrun --nproc-per-node 2 -m commopt.integrations.backend train.py --args``.

Each float32 allreduce with the SUM (or AVG) operation and at least ``COMMOPT_MIN_SIZE``
elements runs :func:`commopt.collectives.allreduce` with the configured codec on a
transport of its own (gloo for CPU tensors, nccl for CUDA tensors); every other collective
(broadcast, allgather, object collectives, barrier, integer or small allreduces, ...)
passes through unchanged to gloo or nccl. DDP hands whole buckets (25 MB by default,
``bucket_cap_mb=``) to allreduce; for the per-layer policy (small and 1-D tensors exact,
quantisation buckets aligned to layers), register the model once after wrapping it:

    state = commopt.integrations.backend.register_model(ddp_model)

Environment (read when the process group is created; see docs/integrations.md):

========================  ========  =====================================================
variable                  default   meaning
========================  ========  =====================================================
``COMMOPT_BITS``          4         2, 4 or 8: QSGD bits; 16: fp16 wire; 32: no compression
``COMMOPT_BUCKET_SIZE``   128       QSGD quantisation bucket (elements per scale)
``COMMOPT_MIN_SIZE``      1024      tensors with fewer elements travel uncompressed
``COMMOPT_COMPRESS_1D``   0         1: compress 1-D tensors too (``register_model`` only)
``COMMOPT_EXCLUDE``       (policy)  comma-separated regexes of parameter names kept exact
``COMMOPT_ERROR_FEEDBACK``  0       1: error feedback (``register_model`` only)
``COMMOPT_SEED``          0         seed of the stochastic rounding
========================  ========  =====================================================

    >>> BackendConfig.from_env({"COMMOPT_BITS": "8"}).codec().name
    'qsgd8'
    >>> BackendConfig.from_env({"COMMOPT_BITS": "32"}).codec() is None
    True
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# _create_work_from_future: present at run time (torch's own multi-threaded test group uses
# it), absent from the stubs; AllgatherOptions: torch.distributed's stubs do not re-export it
from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
    AllgatherOptions,
    _create_work_from_future,
)

from commopt import collectives, driver
from commopt.codecs import QSGD, CompressionPolicy, ErrorFeedback, RngKey, get_codec
from commopt.codecs.policy import DEFAULT_EXCLUDE, DEFAULT_MIN_COMPRESS_NUMEL
from commopt.comm.c10d import C10dCommunicator
from commopt.integrations.ddp import CommoptHookState, commopt_hook

__all__ = [
    "BACKEND_NAME",
    "BackendConfig",
    "CommoptProcessGroup",
    "Counters",
    "register",
    "register_model",
    "stats",
]

BACKEND_NAME = "commopt"
_BITS = (2, 4, 8, 16, 32)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _env_int(env, name: str, default: int, allowed=None, minimum: int | None = None) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}={value}: use one of {', '.join(map(str, allowed))}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")
    return value


def _env_bool(env, name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: use 1 or 0")


@dataclass(frozen=True)
class BackendConfig:
    """What the ``commopt`` backend does, usually read from ``COMMOPT_*`` variables."""

    bits: int = 4
    bucket_size: int = 128
    min_size: int = DEFAULT_MIN_COMPRESS_NUMEL
    compress_1d: bool = False
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    error_feedback: bool = False
    seed: int = 0

    @classmethod
    def from_env(cls, env=None) -> BackendConfig:
        env = os.environ if env is None else env
        exclude = env.get("COMMOPT_EXCLUDE")
        config = cls(
            bits=_env_int(env, "COMMOPT_BITS", 4, allowed=_BITS),
            bucket_size=_env_int(env, "COMMOPT_BUCKET_SIZE", 128, minimum=1),
            min_size=_env_int(env, "COMMOPT_MIN_SIZE", DEFAULT_MIN_COMPRESS_NUMEL, minimum=0),
            compress_1d=_env_bool(env, "COMMOPT_COMPRESS_1D"),
            exclude=DEFAULT_EXCLUDE
            if exclude is None
            else tuple(p.strip() for p in exclude.split(",") if p.strip()),
            error_feedback=_env_bool(env, "COMMOPT_ERROR_FEEDBACK"),
            seed=_env_int(env, "COMMOPT_SEED", 0),
        )
        config.policy()  # a bad COMMOPT_EXCLUDE pattern fails here, naming the pattern
        if config.error_feedback and config.bits == 32:
            raise ValueError(
                "COMMOPT_ERROR_FEEDBACK=1 needs a compressing COMMOPT_BITS (2, 4, 8 or 16)"
            )
        return config

    def codec(self):
        """The compressing codec, or None for ``bits=32`` (everything passes through)."""
        if self.bits == 32:
            return None
        codec = (
            get_codec("fp16")
            if self.bits == 16
            else QSGD(bits=self.bits, bucket_size=self.bucket_size)
        )
        return ErrorFeedback(codec) if self.error_feedback else codec

    def policy(self) -> CompressionPolicy:
        return CompressionPolicy(
            min_compress_numel=self.min_size, exclude=self.exclude, compress_1d=self.compress_1d
        )


@dataclass
class Counters:
    """What one ``commopt`` group did on this rank (see :func:`stats`)."""

    bits: int
    compressed_calls: int = 0
    compressed_elements: int = 0
    passthrough_calls: int = 0
    sent_bytes: int = 0

    def add_sent(self, nbytes: int) -> None:  # called under the communicator's lock
        self.sent_bytes += nbytes


_LAST_COUNTERS: Counters | None = None


class CommoptProcessGroup(dist.ProcessGroup):
    """The process group ``init_process_group("commopt")`` creates.

    gloo (and nccl with CUDA) are registered as its backends, so every collective it does
    not override goes straight to them; ``allreduce`` of large float32 tensors goes to
    commopt's collectives over a transport of its own (``self.comm``).
    """

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        config: BackendConfig | None = None,
    ):
        # (rank, size) is one of the constructor's run-time overloads; the stubs list only the other
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.config = config or BackendConfig.from_env()
        self._codec = self.config.codec()
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        self._gloo = dist.ProcessGroupGloo(
            dist.PrefixStore("pass/gloo/", store), rank, size, timeout
        )
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        # Any: the stubs' Backend classes list none of their collectives
        self._passthrough: dict[str, Any] = {"cpu": self._gloo}
        if cuda:
            # options has a default at run time; the stubs make it required
            nccl = dist.ProcessGroupNCCL(  # type: ignore[call-arg]
                dist.PrefixStore("pass/nccl/", store), rank, size
            )
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
            self._passthrough["cuda"] = nccl
        self._set_default_backend(
            dist.ProcessGroup.BackendType.NCCL if cuda else dist.ProcessGroup.BackendType.GLOO
        )
        self._default_device = "cuda" if cuda else "cpu"
        # commopt's own traffic: separate contexts, so its stages (on commopt's collective
        # thread) never interleave with pass-through collectives issued by the caller.
        self.counters = Counters(bits=self.config.bits)
        self.comm = C10dCommunicator(
            dist.PrefixStore("commopt/", store),
            rank,
            size,
            timeout,
            use_cuda=cuda,
            on_send=self.counters.add_sent,
        )
        self._lock = threading.Lock()
        global _LAST_COUNTERS
        _LAST_COUNTERS = self.counters

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"CommoptProcessGroup(rank={self.rank()}, size={self.size()}, config={self.config})"

    def _compresses(self, tensors, opts) -> bool:
        if self._codec is None or len(tensors) != 1:
            return False
        t = tensors[0]
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() < self.config.min_size:
            return False
        op = opts.reduceOp  # a ReduceOp: `in (SUM, AVG)` would compare the other way round
        return op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG

    # c10d calls allreduce(tensors, opts); the stubs' other overloads are not this group's API
    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        opts = dist.AllreduceOptions() if opts is None else opts
        if not self._compresses(tensors, opts):
            with self._lock:
                self.counters.passthrough_calls += 1
            return self._passthrough[tensors[0].device.type].allreduce(tensors, opts)
        if self.config.error_feedback:
            raise RuntimeError(
                "COMMOPT_ERROR_FEEDBACK=1 keeps one residual per layer, which needs the layers: "
                "call commopt.integrations.backend.register_model(ddp_model) after wrapping the "
                "model in DistributedDataParallel (or unset COMMOPT_ERROR_FEEDBACK)"
            )
        t = tensors[0]
        with self._lock:
            step = self.counters.compressed_calls
            self.counters.compressed_calls += 1
            self.counters.compressed_elements += t.numel()
        rng = RngKey(self.config.seed, self.rank(), step, 0)
        work = collectives.allreduce(
            self.comm,
            t.view(-1),
            self._codec,
            async_op=True,
            average=opts.reduceOp == dist.ReduceOp.AVG,
            rng=rng,
        )
        future: torch.futures.Future = torch.futures.Future()

        def finish() -> None:  # runs on commopt's collective thread, after the reduction
            try:
                work.wait()
                future.set_result([t])
            except Exception as exc:  # the transport's error reaches whoever waits
                future.set_exception(exc)

        driver.then(self.comm, finish)
        return _create_work_from_future(future)

    # -- every other collective: to gloo or nccl, through their Python bindings -------------
    # torch's trampoline for Python subclasses of ProcessGroup calls a collective the subclass
    # does not override with the GIL held, and gloo's enqueue then waits for the lock of its
    # work queue. A gloo worker holds that lock while it frees a finished work, and freeing a
    # tensor that has a Python object takes the GIL (every tensor that passed through
    # ``allreduce`` above has one): each waits for the other, forever. DDP meets it when its
    # bucket rebuild's broadcast follows the first backward's allreduce closely. Each
    # collective below goes to the backend through its Python binding instead, which releases
    # the GIL before it enqueues.
    def _to(self, tensors) -> Any:
        """The pass-through backend for ``tensors`` (a list, or a list of lists)."""
        first = tensors[0] if tensors else None
        while isinstance(first, (list, tuple)):
            first = first[0] if first else None
        device = first.device.type if first is not None else self._default_device
        return self._passthrough[device]

    def broadcast(self, tensors, opts=None):  # type: ignore[override]
        return self._to(tensors).broadcast(tensors, opts or dist.BroadcastOptions())

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._to(input_tensors).allgather(
            output_tensors, input_tensors, opts or AllgatherOptions()
        )

    def all_gather_single(self, output, input, opts=None):
        # (the backends' binding of all_gather_single has only this name)
        return self._to([input])._allgather_base(  # noqa: SLF001
            output, input, opts or AllgatherOptions()
        )

    def allreduce_coalesced(self, tensors, opts=None):
        return self._to(tensors).allreduce_coalesced(
            tensors, opts or dist.AllreduceCoalescedOptions()
        )

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._to([input]).alltoall_base(
            output, input, output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()
        )

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        return self._to(output_tensors).reduce_scatter(
            output_tensors, input_tensors, opts or dist.ReduceScatterOptions()
        )

    def reduce_scatter_single(self, output, input, opts=None):
        # (the backends' binding of reduce_scatter_single has only this name)
        return self._to([output])._reduce_scatter_base(  # noqa: SLF001
            output, input, opts or dist.ReduceScatterOptions()
        )

    def barrier(self, opts=None):
        return self._to([]).barrier(opts or dist.BarrierOptions())

    def send(self, tensors, dstRank, tag):
        return self._to(tensors).send(tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag):
        return self._to(tensors).recv(tensors, srcRank, tag)


def _create(store, rank, size, timeout):
    return CommoptProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register the ``commopt`` backend with torch.distributed (done on import; idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


def _commopt_group(group) -> CommoptProcessGroup:
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, CommoptProcessGroup):
        raise TypeError(
            f"the process group is {dist.get_backend(pg)!r}, not {BACKEND_NAME!r}: "
            f"create it with dist.init_process_group({BACKEND_NAME!r})"
        )
    return pg


class _BackendHookState(CommoptHookState):
    """The DDP hook's state, reducing over the backend's own transport (not through DDP's
    group again, which would compress the already compressed buckets a second time)."""

    def __init__(self, pg: CommoptProcessGroup, **kwargs):
        super().__init__(**kwargs)
        self._pg = pg

    @property
    def comm(self):
        return self._pg.comm

    def __getstate__(self):
        state = super().__getstate__()
        state["_pg"] = None
        return state


def register_model(ddp_model, policy: CompressionPolicy | None = None) -> CommoptHookState:
    """Reduce ``ddp_model``'s gradients layer by layer with the backend's codec.

    ``ddp_model`` is the ``DistributedDataParallel`` wrapper over a ``commopt`` group.
    Tensors the policy (``policy=``, default from ``COMMOPT_MIN_SIZE``, ``COMMOPT_COMPRESS_1D``
    and ``COMMOPT_EXCLUDE``) leaves out travel in float32, and quantisation buckets never
    straddle two layers. Returns the hook's state: save ``state.state_dict()`` with the
    checkpoint (step counter, error-feedback residuals) and load it on resume.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            "register_model takes the DistributedDataParallel model: call it after "
            "ddp_model = DistributedDataParallel(model)"
        )
    pg = _commopt_group(ddp_model.process_group)
    codec = pg.config.codec()
    state = _BackendHookState(
        pg,
        compression=codec if codec is not None else "none",
        model=ddp_model.module,
        policy=policy or pg.config.policy(),
        seed=pg.config.seed,
    )
    ddp_model.register_comm_hook(state, commopt_hook)
    return state


def stats(group=None) -> dict:
    """This rank's counters of a ``commopt`` group: ``group``, else the default group, else
    (after ``destroy_process_group``) the last ``commopt`` group this process created.

    ``compressed_calls``/``compressed_elements``: allreduces that went through the codec;
    ``passthrough_calls``: allreduces handed to gloo/nccl unchanged; ``sent_bytes``: bytes
    commopt's transport sent (both the whole-bucket path and ``register_model``'s hook).
    """
    if group is None and not dist.is_initialized():
        if _LAST_COUNTERS is None:
            raise RuntimeError(f"no {BACKEND_NAME!r} process group was created in this process")
        return dataclasses.asdict(_LAST_COUNTERS)
    return dataclasses.asdict(_commopt_group(group).counters)


if __name__ != "__main__":  # run as a script, the importable module registers (below)
    register()


def _main(argv: list[str]) -> None:
    """``python -m commopt.integrations.backend script.py args``: run a script with the backend."""
    import runpy

    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m commopt.integrations.backend SCRIPT.py [ARGS...]\n"
            "Runs SCRIPT with the 'commopt' torch.distributed backend registered, so that\n"
            "dist.init_process_group('commopt') works without importing commopt."
        )
        raise SystemExit(0 if argv else 2)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    # Register through the importable module (not this __main__ copy), then run the script.
    import commopt.integrations.backend  # noqa: F401

    _main(sys.argv[1:])
