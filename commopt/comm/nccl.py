"""NCCL transport through CuPy's bindings, bootstrapped over MPI ("pure_nccl").

    $ mpirun -np 8 python train.py      # each rank: torch.cuda.set_device(local_rank) first
    comm = commopt.create_communicator("pure_nccl", allreduce_grad_dtype="float16")

The NCCL communicator is created lazily, on the first collective, so the user sets the
CUDA device first (as ChainerMN's pure_nccl did): rank 0 makes the unique id, MPI
broadcasts it, every rank joins. Collectives run on a dedicated CUDA stream that first
waits for the caller's current stream; ``Work.wait()`` makes the caller's current stream
wait for the collective (the host does not block). Object helpers, barrier and split run
over the MPI communicator used for the bootstrap.

Threads: call from one thread per communicator (NCCL kernels are enqueued in call order).
"""
from __future__ import annotations

from typing import Any

import torch

from commopt.comm.base import Communicator, Work

# ncclDataType_t values (nccl.h); stable across NCCL 2.x.
_NCCL_DTYPE = {
    torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
    torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
_NCCL_SUM = 0


def _cupy_nccl():
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ImportError(
            "the 'pure_nccl' communicator needs CuPy with NCCL: pip install 'commopt[nccl]' "
            "(cupy-cuda12x) on a machine with CUDA"
        ) from exc
    return nccl


class _StreamWork(Work):
    def __init__(self, event: torch.cuda.Event):
        self._event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event.query()


class NcclCommunicator(Communicator):
    """Communicator over NCCL (CUDA tensors only). Options: ``mpi_comm`` for the bootstrap."""

    name = "pure_nccl"

    def __init__(self, *, allreduce_grad_dtype: torch.dtype | None = None, mpi_comm=None):
        super().__init__(allreduce_grad_dtype=allreduce_grad_dtype)
        _cupy_nccl()  # fail early, with the install hint, if CuPy is missing
        if not torch.cuda.is_available():
            raise RuntimeError("the 'pure_nccl' communicator needs a CUDA device; use 'mpi' or 'torch' on CPU")
        from commopt.comm.mpi import MPICommunicator

        self._boot = MPICommunicator(mpi_comm=mpi_comm)
        self.rank, self.size = self._boot.rank, self._boot.size
        self.intra_rank, self.intra_size = self._boot.intra_rank, self._boot.intra_size
        self.inter_rank, self.inter_size = self._boot.inter_rank, self._boot.inter_size
        self._nccl_comm = None
        self._stream: torch.cuda.Stream | None = None

    def _ensure(self):
        """Create the NCCL communicator and stream on first use, on the current device."""
        if self._nccl_comm is None:
            nccl = _cupy_nccl()
            uid = nccl.get_unique_id() if self.rank == 0 else None
            uid = self._boot.bcast_obj(uid, root=0)
            self._stream = torch.cuda.Stream()
            self._nccl_comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        return self._nccl_comm

    def _launch(self, tensors, enqueue) -> Work:
        for t in tensors:
            if not t.is_cuda:
                raise TypeError("pure_nccl moves CUDA tensors only; use the 'mpi' communicator for CPU tensors")
        comm = self._ensure()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            enqueue(comm, stream.cuda_stream)
            for t in tensors:
                t.record_stream(stream)  # keep the memory alive until the stream is done
            event = torch.cuda.Event()
            event.record(stream)
        return _StreamWork(event)

    def _allreduce(self, buf: torch.Tensor) -> Work:
        return self._launch([buf], lambda c, s: c.allReduce(
            buf.data_ptr(), buf.data_ptr(), buf.numel(), _NCCL_DTYPE[buf.dtype], _NCCL_SUM, s))

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        nccl = _cupy_nccl()
        nbytes = send.numel() * send.element_size() // self.size

        def enqueue(c, s):
            nccl.groupStart()
            for peer in range(self.size):
                c.send(send.data_ptr() + peer * nbytes, nbytes, 1, peer, s)
                c.recv(recv.data_ptr() + peer * nbytes, nbytes, 1, peer, s)
            nccl.groupEnd()

        return self._launch([send, recv], enqueue)

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        nbytes = send.numel() * send.element_size()
        return self._launch([send, recv], lambda c, s: c.allGather(
            send.data_ptr(), recv.data_ptr(), nbytes, 1, s))

    def _broadcast(self, buf: torch.Tensor, root: int) -> Work:
        nbytes = buf.numel() * buf.element_size()
        return self._launch([buf], lambda c, s: c.bcast(buf.data_ptr(), nbytes, 1, root, s))

    def _barrier(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._boot.barrier()

    def _bcast_obj(self, obj: Any, root: int) -> Any:
        return self._boot.bcast_obj(obj, root)

    def _allgather_obj(self, obj: Any) -> list:
        return self._boot.allgather_obj(obj)

    def _split(self, color: int, key: int) -> "NcclCommunicator":
        sub = self._boot.split(color, key)
        return NcclCommunicator(allreduce_grad_dtype=self.allreduce_grad_dtype, mpi_comm=sub.mpi_comm)

    def supports_sum(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16)

    def finalize(self) -> None:
        self._boot.finalize()
