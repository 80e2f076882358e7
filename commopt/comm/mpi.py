"""MPI transport over mpi4py.

    $ commopt launch -n 2 -- python -c "
    import torch, commopt
    comm = commopt.create_communicator('mpi')
    t = torch.full((4,), float(comm.rank)); comm.allreduce(t); print(comm.rank, t.tolist())"

Threads: every operation of one communicator (collectives, object helpers, barrier, split)
runs on that communicator's single worker thread, in the order it was issued; the caller
waits on the returned Work (or at once for the synchronous forms). MPI is therefore called
from one thread per communicator, and a collective in flight overlaps the caller's
computation (mpi4py releases the GIL inside MPI). The public methods are safe to call from
several threads, but all ranks must issue operations in the same order.

Data: CPU tensors travel zero-copy through NumPy views. MPI has no 16-bit float type, so
fp16 and bf16 sums use a user-defined reduction that adds in fp32 and rounds to nearest
even once per pairwise addition: the wire still carries 16 bits. CUDA tensors are staged
through pinned host memory unless the MPI library reports CUDA support.

A Python exception that escapes on any rank aborts the whole job (MPI_Abort) after its
traceback is printed, so the other ranks do not wait forever in a collective.
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from commopt.comm.base import Communicator, FutureWork, Work

_MPI = None
_USER_OPS: dict[torch.dtype, Any] = {}


def _mpi():
    """Import mpi4py lazily; a missing package names what to install."""
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the 'mpi' communicator needs mpi4py and an MPI library: "
                "pip install 'commopt[mpi]' (and apt-get install openmpi-bin libopenmpi-dev)"
            ) from exc
        _MPI = MPI
        _install_abort_hook(MPI)
    return _MPI


def _install_abort_hook(MPI) -> None:
    """An uncaught exception on one rank aborts the job instead of hanging its peers."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


# -- 16-bit reductions ---------------------------------------------------------------------
def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does; NaN stays NaN."""
    bits = f32.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def _sum_fp16(inbuf, inoutbuf, datatype) -> None:
    a = np.frombuffer(inbuf, dtype=np.float16)
    b = np.frombuffer(inoutbuf, dtype=np.float16)
    # Add in fp32 and round once: the same as torch's fp16 addition.
    b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)


def _sum_bf16(inbuf, inoutbuf, datatype) -> None:
    a = np.frombuffer(inbuf, dtype=np.uint16)
    b = np.frombuffer(inoutbuf, dtype=np.uint16)
    b[...] = _f32_to_bf16(_bf16_to_f32(a) + _bf16_to_f32(b))


def _user_op(dtype: torch.dtype):
    MPI = _mpi()
    if dtype not in _USER_OPS:
        fn = _sum_fp16 if dtype == torch.float16 else _sum_bf16
        _USER_OPS[dtype] = MPI.Op.Create(fn, commute=True)
    return _USER_OPS[dtype]


def _mpi_type(dtype: torch.dtype):
    MPI = _mpi()
    return {
        torch.float32: MPI.FLOAT,
        torch.float64: MPI.DOUBLE,
        torch.int32: MPI.INT32_T,
        torch.int64: MPI.INT64_T,
        torch.float16: MPI.INT16_T,  # raw 16-bit words, summed by a user-defined op
        torch.bfloat16: MPI.INT16_T,
    }[dtype]


def _numpy_view(t: torch.Tensor, as_bytes: bool = False) -> np.ndarray:
    """A NumPy array sharing memory with the contiguous CPU tensor ``t``."""
    flat = t.reshape(-1)
    if as_bytes:
        return flat.view(torch.uint8).numpy()
    if t.dtype in (torch.float16, torch.bfloat16):
        return flat.view(torch.int16).numpy()
    return flat.numpy()


class MPICommunicator(Communicator):
    """Communicator over an mpi4py communicator (a duplicate of COMM_WORLD by default).

    Options: ``mpi_comm`` (an mpi4py communicator to duplicate), ``cuda_aware`` (force
    the CUDA-aware path on or off; by default asked from the MPI library).
    """

    name = "mpi"

    def __init__(self, *, allreduce_grad_dtype: torch.dtype | None = None, mpi_comm=None,
                 cuda_aware: bool | None = None, _dup: bool = True):
        super().__init__(allreduce_grad_dtype=allreduce_grad_dtype)
        MPI = _mpi()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        # Our own context keeps commopt's messages apart from the application's.
        self.mpi_comm = base.Dup() if _dup else base
        self.rank = self.mpi_comm.Get_rank()
        self.size = self.mpi_comm.Get_size()
        if cuda_aware is None:
            query = getattr(MPI, "Query_cuda_support", None)
            cuda_aware = bool(query()) if query is not None else False
        self.cuda_aware = cuda_aware
        self._thread_prefix = f"commopt-mpi-{id(self):x}"
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_prefix)
        self._lock = threading.Lock()
        self._init_topology()

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
        op = _user_op(buf.dtype) if buf.dtype in (torch.float16, torch.bfloat16) else MPI.SUM

        def run():
            ready()
            host, back = self._host(buf, fill=True)
            self.mpi_comm.Allreduce(MPI.IN_PLACE, [_numpy_view(host), _mpi_type(buf.dtype)], op=op)
            if back:
                back()

        return self._submit(run)

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        ready = self._cuda_ready(send)

        def run():
            ready()
            s, _ = self._host(send, fill=True)
            r, back = self._host(recv, fill=False)
            self.mpi_comm.Alltoall(_numpy_view(s, as_bytes=True), _numpy_view(r, as_bytes=True))
            if back:
                back()

        return self._submit(run)

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        ready = self._cuda_ready(send)

        def run():
            ready()
            s, _ = self._host(send, fill=True)
            r, back = self._host(recv, fill=False)
            self.mpi_comm.Allgather(_numpy_view(s, as_bytes=True), _numpy_view(r, as_bytes=True))
            if back:
                back()

        return self._submit(run)

    def _broadcast(self, buf: torch.Tensor, root: int) -> Work:
        ready = self._cuda_ready(buf)

        def run():
            ready()
            host, back = self._host(buf, fill=self.rank == root)
            self.mpi_comm.Bcast(_numpy_view(host, as_bytes=True), root=root)
            if back:
                back()

        return self._submit(run)

    def _barrier(self) -> None:
        self._call(self.mpi_comm.Barrier)

    def _bcast_obj(self, obj: Any, root: int) -> Any:
        return self._call(lambda: self.mpi_comm.bcast(obj, root=root))

    def _allgather_obj(self, obj: Any) -> list:
        return self._call(lambda: self.mpi_comm.allgather(obj))

    def _split(self, color: int, key: int) -> "MPICommunicator":
        sub = self._call(lambda: self.mpi_comm.Split(color, key))
        return MPICommunicator(allreduce_grad_dtype=self.allreduce_grad_dtype, mpi_comm=sub,
                               cuda_aware=self.cuda_aware, _dup=False)

    def supports_sum(self, dtype: torch.dtype) -> bool:
        # fp16/bf16 sums are correct but run a Python reduction: better done in fp32 by
        # commopt's own scatter-reduce/allgather.
        return dtype in (torch.float32, torch.float64, torch.int32, torch.int64)

    def finalize(self) -> None:
        self._worker.shutdown(wait=True)
        MPI = _mpi()
        if not MPI.Is_finalized() and self.mpi_comm != MPI.COMM_WORLD:
            try:
                self.mpi_comm.Free()
            except MPI.Exception:  # pragma: no cover - already freed
                pass
