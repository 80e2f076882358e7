"""MPICommunicator: the Communicator over mpi4py (threads, staging, path per collective).

Every operation runs on the communicator's one worker thread, in issue order; see
:mod:`commopt.comm.mpi` for the design and the pipelined paths.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from commopt.comm.base import Communicator, FutureWork, Work
from commopt.comm.mpi.p2p import direct_allgather, pairwise_alltoall, ring_allreduce, wait_polled
from commopt.comm.mpi.runtime import _mpi, install_exit_handshake, mpi_type, numpy_view
from commopt.comm.mpi.settings import (
    PIPELINE_ENV, PIPELINE_MIN_ENV, SEGMENT_ENV, pipeline_settings, transfer_path,
)
from commopt.comm.mpi.user_ops import sum16_op

__all__ = ["MPICommunicator"]


class MPICommunicator(Communicator):
    """Communicator over an mpi4py communicator (a duplicate of COMM_WORLD by default).

    Options: ``mpi_comm`` (an mpi4py communicator to duplicate), ``cuda_aware`` (force
    the CUDA-aware path on or off; by default asked from the MPI library), ``pipeline``
    (``"auto"``: when the ranks span several nodes, pipelined segment transfers for buffers
    of at least ``pipeline_min_bytes`` and polled nonblocking MPI collectives below;
    ``"on"``: the same on one node too; ``"off"``: MPI's own blocking collectives, as
    before), ``segment_bytes`` (default: just under the TCP eager limit, see
    :func:`default_segment_bytes`), ``pipeline_min_bytes`` (default 256 KiB). Environment:
    COMMOPT_MPI_PIPELINE, COMMOPT_MPI_SEGMENT_BYTES, COMMOPT_MPI_PIPELINE_MIN_BYTES (the
    options win). Every rank must use the same settings; the constructor checks.

        >>> comm = MPICommunicator(pipeline="off")          # doctest: +SKIP
    """

    name = "mpi"

    def __init__(self, *, allreduce_grad_dtype: torch.dtype | None = None, mpi_comm=None,
                 cuda_aware: bool | None = None, pipeline: str | bool | None = None,
                 segment_bytes: int | str | None = None,
                 pipeline_min_bytes: int | str | None = None, _dup: bool = True):
        super().__init__(allreduce_grad_dtype=allreduce_grad_dtype)
        MPI = _mpi()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        # Our own context keeps commopt's messages apart from the application's.
        self.mpi_comm = base.Dup() if _dup else base
        if mpi_comm is None:  # every rank of the world is here: a rank leaving early aborts
            install_exit_handshake()
        self.rank = self.mpi_comm.Get_rank()
        self.size = self.mpi_comm.Get_size()
        if cuda_aware is None:
            query = getattr(MPI, "Query_cuda_support", None)
            cuda_aware = bool(query()) if query is not None else False
        self.cuda_aware = cuda_aware
        self.pipeline, self.segment_bytes, self.pipeline_min_bytes = pipeline_settings(
            pipeline, segment_bytes, pipeline_min_bytes)
        self._scratch_buf: torch.Tensor | None = None
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
                f"the same {PIPELINE_ENV}, {SEGMENT_ENV}, {PIPELINE_MIN_ENV} and eager limit.")

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A reusable byte buffer for the worker thread (fresh pages cost a fault each)."""
        if self._scratch_buf is None or self._scratch_buf.numel() < nbytes:
            self._scratch_buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch_buf

    def _path(self, nbytes: int) -> str:
        """pipelined, polled or blocking: see :func:`transfer_path`."""
        return transfer_path(self.pipeline, nbytes, size=self.size, inter_size=self.inter_size,
                             min_bytes=self.pipeline_min_bytes)

    # -- running on the worker -------------------------------------------------------
    def _submit(self, fn: Callable[[], Any], finalize: Callable[[], None] | None = None) -> FutureWork:
        with self._lock:  # one submission order, even with several calling threads
            return FutureWork(self._worker.submit(fn), finalize)

    def _call(self, fn: Callable[[], Any]) -> Any:
        return self._worker.submit(fn).result() if not self._on_worker() else fn()

    def _on_worker(self) -> bool:
        return threading.current_thread().name.startswith(self._thread_prefix)

    def _host(self, t: torch.Tensor, fill: bool):
        """(host tensor, copy-back function) for CUDA tensors; the tensor itself on CPU."""
        if t.device.type == "cpu" or self.cuda_aware:
            return t, None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if fill:
            host.copy_(t)
        return host, (lambda: t.copy_(host))

    def _cuda_ready(self, *tensors: torch.Tensor) -> Callable[[], None]:
        """Make the worker wait for the kernels that produce CUDA inputs (not the caller)."""
        if not any(t.is_cuda for t in tensors):
            return lambda: None
        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    # -- primitives -----------------------------------------------------------------------
    def _allreduce(self, buf: torch.Tensor) -> Work:
        MPI = _mpi()
        ready = self._cuda_ready(buf)
        op = sum16_op(buf.dtype) if buf.dtype in (torch.float16, torch.bfloat16) else MPI.SUM

        path = self._path(buf.numel() * buf.element_size())
        seg_elems = max(1, self.segment_bytes // buf.element_size())

        def run():
            ready()
            host, back = self._host(buf, fill=True)
            data = [numpy_view(host), mpi_type(buf.dtype)]
            if path == "pipelined":
                block = math.ceil(host.numel() / self.size) * host.element_size()
                ring_allreduce(self.mpi_comm, host.reshape(-1), seg_elems, self._scratch(block))
            elif path == "polled":
                wait_polled(self.mpi_comm.Iallreduce(MPI.IN_PLACE, data, op=op))
            else:
                self.mpi_comm.Allreduce(MPI.IN_PLACE, data, op=op)
            if back:
                back()

        return self._submit(run)

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        return self._exchange_op(send, recv, send.numel() * send.element_size(), pairwise_alltoall,
                                 self.mpi_comm.Ialltoall, self.mpi_comm.Alltoall)

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        return self._exchange_op(send, recv, recv.numel() * recv.element_size(), direct_allgather,
                                 self.mpi_comm.Iallgather, self.mpi_comm.Allgather)

    def _exchange_op(self, send: torch.Tensor, recv: torch.Tensor, nbytes: int, pipelined,
                     nonblocking, blocking) -> Work:
        """An all-to-all style collective on bytes by the path ``nbytes`` calls for: commopt's
        ``pipelined`` point-to-point version, MPI's ``nonblocking`` one polled, or ``blocking``."""
        ready = self._cuda_ready(send)
        path = self._path(nbytes)

        def run():
            ready()
            s, _ = self._host(send, fill=True)
            r, back = self._host(recv, fill=False)
            sv, rv = numpy_view(s, as_bytes=True), numpy_view(r, as_bytes=True)
            if path == "pipelined":
                pipelined(self.mpi_comm, sv, rv, self.segment_bytes)
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
            self.mpi_comm.Bcast(numpy_view(host, as_bytes=True), root=root)
            if back:
                back()

        return self._submit(run)

    def _barrier(self) -> None:
        self._call(self.mpi_comm.Barrier)

    # bcast_obj/allgather_obj: the base class's JSON + bytes path over _broadcast/_allgather
    # (mpi4py's lowercase bcast/allgather would unpickle what peers send).

    def _split(self, color: int, key: int) -> "MPICommunicator":
        sub = self._call(lambda: self.mpi_comm.Split(color, key))
        return MPICommunicator(allreduce_grad_dtype=self.allreduce_grad_dtype, mpi_comm=sub,
                               cuda_aware=self.cuda_aware, pipeline=self.pipeline,
                               segment_bytes=self.segment_bytes,
                               pipeline_min_bytes=self.pipeline_min_bytes, _dup=False)

    def supports_sum(self, dtype: torch.dtype) -> bool:
        if dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
            return True
        # fp16/bf16: MPI's own collectives sum them with a Python reduction, better left to
        # commopt's scatter-reduce/allgather (fp32 on the side). Between nodes large buffers
        # take the pipelined ring, which adds 16-bit segments with torch (rounding once per
        # addition, as gloo and NCCL do) at full speed.
        return (dtype in (torch.float16, torch.bfloat16) and transfer_path(
            self.pipeline, 1 << 62, size=self.size, inter_size=self.inter_size,
            min_bytes=self.pipeline_min_bytes) == "pipelined")

    def finalize(self) -> None:
        self._worker.shutdown(wait=True)
        MPI = _mpi()
        if not MPI.Is_finalized() and self.mpi_comm != MPI.COMM_WORLD:
            try:
                self.mpi_comm.Free()
            except MPI.Exception:  # pragma: no cover - already freed
                pass
