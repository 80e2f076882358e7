"""MPICommunicator: the Communicator over mpi4py (threads, staging, path per collective).

Every operation runs on the communicator's one worker thread, in issue order; see
:mod:`commopt.comm.mpi` for the design and the pipelined paths.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from commopt.comm.base import NATIVE_SUM_DTYPES, Communicator, FutureWork, Work
from commopt.comm.mpi.p2p import direct_allgather, pairwise_alltoall, ring_allreduce, wait_polled
from commopt.comm.mpi.runtime import _mpi, install_exit_handshake, mpi_type, numpy_view
from commopt.comm.mpi.settings import (
    PIPELINE_ENV,
    PIPELINE_MIN_ENV,
    SEGMENT_ENV,
    pipeline_settings,
    transfer_path,
)
from commopt.comm.mpi.user_ops import sum16_op
from commopt.comm.timeout import ProgressWatch, comm_timeout, say, unwatch, watch

__all__ = [
    "MPICommunicator",
    "detect_cuda_aware",
    "live_mpi_communicators",
    "ready_after_producers",
]

#: ids of the MPICommunicators whose MPI communicator is not freed yet (for leak checks).
_LIVE_COMMS: set[int] = set()


def live_mpi_communicators() -> int:
    """How many MPI communicators commopt created and has not freed (``finalize()`` frees)."""
    return len(_LIVE_COMMS)


#: Environment variable that forces the CUDA-aware path on (1) or off (0).
CUDA_AWARE_ENV = "COMMOPT_MPI_CUDA_AWARE"


def detect_cuda_aware(MPI) -> bool:
    """Whether the MPI library reads and writes CUDA memory itself; False when unknown.

    $COMMOPT_MPI_CUDA_AWARE decides when set; else ``MPI.Query_cuda_support`` where the
    mpi4py offers it; else the library's ``MPIX_Query_cuda_support`` (Open MPI, MPICH),
    looked up through mpi4py's extension module, which links the library. Staging through
    host memory is always correct, so anything unknown means False.
    """
    import os

    forced = os.environ.get(CUDA_AWARE_ENV, "").strip().lower()
    if forced:
        if forced not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(
                f"{CUDA_AWARE_ENV}={forced!r}: give 1 (CUDA-aware MPI) or 0 (stage "
                f"CUDA tensors through host memory)"
            )
        return forced in ("1", "true", "yes", "on")
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return bool(query())
    import ctypes

    try:
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):  # not Open MPI/MPICH, or built without the extension
        return False
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return bool(fn())


def ready_after_producers(devices, streams=None) -> Callable[[], None]:
    """A function that blocks until the work so far on each device's current stream is done.

    Called on the issuing thread: the event of each device is recorded on *that device's*
    current stream (not the current device's), so a tensor on cuda:1 issued while cuda:0
    is current is still waited for. The worker thread calls the result before it reads.
    """
    devices = list(dict.fromkeys(devices))
    if not devices:
        return lambda: None
    if streams is None:
        from commopt.comm.streams import CudaStreams

        streams = CudaStreams()
    events = [streams.record(streams.current(d)) for d in devices]

    def wait() -> None:
        for e in events:
            streams.synchronize(e)

    return wait


def _end_job(message: str) -> None:
    """The watchdog's verdict: say why, then abort the whole job (every rank's mpirun kills).

    If MPI_Abort itself cannot reach mpirun (its daemon sits behind the failed link), the
    process still ends 6 s later.
    """
    say(message)
    ender = threading.Timer(6.0, os._exit, (1,))
    ender.daemon = True
    ender.start()
    # The peers' clocks ran out at about the same moment: a second lets them say so too
    # before MPI_Abort has mpirun kill them.
    time.sleep(1.0)
    _mpi().COMM_WORLD.Abort(1)


class MPICommunicator(Communicator):
    """Communicator over an mpi4py communicator (a duplicate of COMM_WORLD by default).

    Options: ``mpi_comm`` (an mpi4py communicator to duplicate), ``cuda_aware`` (force
    the CUDA-aware path on or off; by default asked from the MPI library), ``pipeline``
    (``"auto"``: when the ranks span several nodes, pipelined segment transfers for buffers
    of at least ``pipeline_min_bytes`` and polled nonblocking MPI collectives below;
    ``"on"``: the same on one node too; ``"off"``: MPI's own blocking collectives, as
    before), ``segment_bytes`` (default: just under the TCP eager limit, see
    :func:`default_segment_bytes`), ``pipeline_min_bytes`` (default 256 KiB), ``timeout``
    (seconds a collective may go without progress, see :mod:`commopt.comm.timeout`).
    Environment: COMMOPT_MPI_PIPELINE, COMMOPT_MPI_SEGMENT_BYTES,
    COMMOPT_MPI_PIPELINE_MIN_BYTES, COMMOPT_COMM_TIMEOUT (the options win). Every rank must
    use the same pipeline settings; the constructor checks.

    Bounded waits: every collective runs under a per-peer clock. On the pipelined path each
    segment that arrives from (or leaves for) a peer restarts that peer's clock, so a slow
    link keeps going; MPI's own collectives (the polled and blocking paths) restart it only
    when they complete. When a peer's clock passes the timeout, the process's watchdog
    prints which rank and collective, and aborts the job.

        >>> comm = MPICommunicator(pipeline="off")  # doctest: +SKIP
    """

    name = "mpi"

    def __init__(
        self,
        *,
        allreduce_grad_dtype: torch.dtype | None = None,
        mpi_comm=None,
        cuda_aware: bool | None = None,
        pipeline: str | bool | None = None,
        segment_bytes: int | str | None = None,
        pipeline_min_bytes: int | str | None = None,
        timeout: float | str | None = None,
        _dup: bool = True,
    ):
        super().__init__(allreduce_grad_dtype=allreduce_grad_dtype)
        MPI = _mpi()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        # Our own context keeps commopt's messages apart from the application's.
        self.mpi_comm = base.Dup() if _dup else base
        if self.mpi_comm != MPI.COMM_WORLD:
            _LIVE_COMMS.add(id(self))  # ours to free in finalize()
        if mpi_comm is None:  # every rank of the world is here: a rank leaving early aborts
            install_exit_handshake()
        self.rank = self.mpi_comm.Get_rank()
        self.size = self.mpi_comm.Get_size()
        self.timeout = comm_timeout(timeout)
        mine, world = self.mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
        self._world_ranks = MPI.Group.Translate_ranks(mine, list(range(self.size)), world)
        mine.Free()
        world.Free()
        # The watchdog's registry must not keep this communicator alive: a weak reference.
        self._watch = watch(
            ProgressWatch(
                self.timeout,
                rank=self._world_ranks[self.rank],
                ranks_of=_peer_names(weakref.ref(self), self._world_ranks),
            ),
            _end_job,
        )
        self.cuda_aware = detect_cuda_aware(MPI) if cuda_aware is None else bool(cuda_aware)
        self.pipeline, self.segment_bytes, self.pipeline_min_bytes = pipeline_settings(
            pipeline, segment_bytes, pipeline_min_bytes
        )
        self._scratch_buf: torch.Tensor | None = None
        self._objects = threading.local()  # .active while this thread exchanges objects
        self._thread_prefix = f"commopt-mpi-{id(self):x}"
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_prefix)
        self._lock = threading.Lock()
        self._init_topology()
        settings = (self.pipeline, self.segment_bytes, self.pipeline_min_bytes)
        everyone = self.allgather_obj(settings) if self.size > 1 else [settings]
        if any(x != settings for x in everyone):
            raise ValueError(
                f"rank {self.rank}: the ranks disagree on the MPI pipeline settings "
                f"(pipeline, segment_bytes, pipeline_min_bytes): {everyone}. Give every rank "
                f"the same {PIPELINE_ENV}, {SEGMENT_ENV}, {PIPELINE_MIN_ENV} and eager limit."
            )

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A reusable byte buffer for the worker thread (fresh pages cost a fault each)."""
        if self._scratch_buf is None or self._scratch_buf.numel() < nbytes:
            self._scratch_buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch_buf

    def _path(self, nbytes: int) -> str:
        """pipelined, polled or blocking: see :func:`transfer_path`."""
        if getattr(self._objects, "active", False):
            # Objects (settings, topology, fingerprints) go by MPI's blocking collectives on
            # every rank: the pipeline settings that choose the path are what ranks compare,
            # and a blocking collective never matches a nonblocking one on a peer.
            return "blocking"
        return transfer_path(
            self.pipeline,
            nbytes,
            size=self.size,
            inter_size=self.inter_size,
            min_bytes=self.pipeline_min_bytes,
        )

    @contextlib.contextmanager
    def _bounded(self, what: str, nbytes: int, peers: Iterable[int] | None = None):
        """Run a collective (on the worker) under the peers' clocks: all others by default."""
        if peers is None:
            peers = [p for p in range(self.size) if p != self.rank]
        self._watch.begin(f"{what} of {nbytes} bytes", peers)
        try:
            yield self._watch
        finally:
            self._watch.end()

    # -- running on the worker -------------------------------------------------------
    def _submit(
        self, fn: Callable[[], Any], finalize: Callable[[], None] | None = None
    ) -> FutureWork:
        with self._lock:  # one submission order, even with several calling threads
            return FutureWork(self._worker.submit(fn), finalize)

    def _call(self, fn: Callable[[], Any]) -> Any:
        return self._worker.submit(fn).result() if not self._on_worker() else fn()

    def _on_worker(self) -> bool:
        return threading.current_thread().name.startswith(self._thread_prefix)

    def _host(self, t: torch.Tensor, fill: bool, path: str = "blocking"):
        """(host tensor, copy-back function) for CUDA tensors; the tensor itself on CPU.

        CUDA-aware MPI gets CUDA tensors as they are (see :func:`numpy_view`), except on
        the pipelined path, whose segment arithmetic runs on the host.
        """
        if t.device.type == "cpu" or (self.cuda_aware and path != "pipelined"):
            return t, None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if fill:
            host.copy_(t)
        return host, (lambda: t.copy_(host))

    def _cuda_ready(self, *tensors: torch.Tensor) -> Callable[[], None]:
        """Make the worker wait for the kernels that produce CUDA inputs (not the caller)."""
        return ready_after_producers([t.device for t in tensors if t.is_cuda])

    # -- primitives -----------------------------------------------------------------------
    def _allreduce(self, buf: torch.Tensor) -> Work:
        MPI = _mpi()
        ready = self._cuda_ready(buf)
        op = sum16_op(buf.dtype) if buf.dtype in (torch.float16, torch.bfloat16) else MPI.SUM

        path = self._path(buf.numel() * buf.element_size())
        seg_elems = max(1, self.segment_bytes // buf.element_size())

        nbytes = buf.numel() * buf.element_size()
        ring = {(self.rank - 1) % self.size, (self.rank + 1) % self.size} - {self.rank}

        def run():
            ready()
            host, back = self._host(buf, fill=True, path=path)
            data = [numpy_view(host), mpi_type(buf.dtype)]
            if path == "pipelined":
                block = math.ceil(host.numel() / self.size) * host.element_size()
                with self._bounded("allreduce (pipelined ring)", nbytes, ring) as w:
                    ring_allreduce(
                        self.mpi_comm, host.reshape(-1), seg_elems, self._scratch(block), w
                    )
            elif path == "polled":
                with self._bounded("allreduce (MPI_Iallreduce)", nbytes):
                    wait_polled(self.mpi_comm.Iallreduce(MPI.IN_PLACE, data, op=op))
            else:
                with self._bounded("allreduce (MPI_Allreduce)", nbytes):
                    self.mpi_comm.Allreduce(MPI.IN_PLACE, data, op=op)
            if back:
                back()

        return self._submit(run)

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        return self._exchange_op(
            send,
            recv,
            send.numel() * send.element_size(),
            pairwise_alltoall,
            self.mpi_comm.Ialltoall,
            self.mpi_comm.Alltoall,
            "alltoall",
        )

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        return self._exchange_op(
            send,
            recv,
            recv.numel() * recv.element_size(),
            direct_allgather,
            self.mpi_comm.Iallgather,
            self.mpi_comm.Allgather,
            "allgather",
        )

    def _exchange_op(
        self,
        send: torch.Tensor,
        recv: torch.Tensor,
        nbytes: int,
        pipelined,
        nonblocking,
        blocking,
        what: str,
    ) -> Work:
        """An all-to-all style collective on bytes by the path ``nbytes`` calls for: commopt's
        ``pipelined`` point-to-point version, MPI's ``nonblocking`` one polled, or ``blocking``."""
        ready = self._cuda_ready(send)
        path = self._path(nbytes)

        def run():
            ready()
            s, _ = self._host(send, fill=True, path=path)
            r, back = self._host(recv, fill=False, path=path)
            sv, rv = numpy_view(s, as_bytes=True), numpy_view(r, as_bytes=True)
            with self._bounded(f"{what} ({path})", nbytes) as w:
                if path == "pipelined":
                    pipelined(self.mpi_comm, sv, rv, self.segment_bytes, w)
                elif path == "polled":
                    wait_polled(nonblocking(sv, rv))
                else:
                    blocking(sv, rv)
            if back:
                back()

        return self._submit(run)

    def _broadcast(self, buf: torch.Tensor, root: int) -> Work:
        ready = self._cuda_ready(buf)

        def run():
            ready()
            host, back = self._host(buf, fill=self.rank == root)
            peers = [root] if self.rank != root else None
            with self._bounded(
                f"broadcast from rank {root}", buf.numel() * buf.element_size(), peers
            ):
                self.mpi_comm.Bcast(numpy_view(host, as_bytes=True), root=root)
            if back:
                back()

        return self._submit(run)

    def _barrier(self) -> None:
        def run():
            with self._bounded("barrier", 0):
                self.mpi_comm.Barrier()

        self._call(run)

    # bcast_obj/allgather_obj: the base class's JSON + bytes path over _broadcast/_allgather
    # (mpi4py's lowercase bcast/allgather would unpickle what peers send), on the blocking path.
    def _allgather_obj(self, obj: Any) -> list:
        self._objects.active = True
        try:
            return super()._allgather_obj(obj)
        finally:
            self._objects.active = False

    def _split(self, color: int, key: int) -> MPICommunicator:
        def run():
            with self._bounded("split", 0):
                return self.mpi_comm.Split(color, key)

        sub = self._call(run)
        return MPICommunicator(
            allreduce_grad_dtype=self.allreduce_grad_dtype,
            mpi_comm=sub,
            cuda_aware=self.cuda_aware,
            pipeline=self.pipeline,
            segment_bytes=self.segment_bytes,
            pipeline_min_bytes=self.pipeline_min_bytes,
            timeout=self.timeout,
            _dup=False,
        )

    def supports_sum(self, dtype: torch.dtype) -> bool:
        if dtype in NATIVE_SUM_DTYPES:
            return True
        # fp16/bf16: MPI's own collectives sum them with a Python reduction, better left to
        # commopt's scatter-reduce/allgather (fp32 on the side). Between nodes large buffers
        # take the pipelined ring, which adds 16-bit segments with torch (rounding once per
        # addition, as gloo and NCCL do) at full speed.
        return (
            dtype in (torch.float16, torch.bfloat16)
            and transfer_path(
                self.pipeline,
                1 << 62,
                size=self.size,
                inter_size=self.inter_size,
                min_bytes=self.pipeline_min_bytes,
            )
            == "pipelined"
        )

    def _release(self) -> None:
        # Not joining from the worker itself (a last reference dropped there).
        self._worker.shutdown(wait=not self._on_worker())
        unwatch(self._watch)
        MPI = _mpi()
        if not MPI.Is_finalized() and self.mpi_comm != MPI.COMM_WORLD:
            try:
                if self.mpi_comm != MPI.COMM_NULL:
                    self.mpi_comm.Free()
                    _LIVE_COMMS.discard(id(self))
            except MPI.Exception:  # pragma: no cover - already freed
                pass


def _peer_names(comm_ref, world_ranks: list[int]) -> Callable[[Iterable[int]], str]:
    """Peers by world rank, with their node where known: ``1 (host1)``."""

    def names(peers: Iterable[int]) -> str:
        comm = comm_ref()
        nodes = getattr(comm, "node_names", None) if comm is not None else None
        return ", ".join(f"{world_ranks[p]}" + (f" ({nodes[p]})" if nodes else "") for p in peers)

    return names
