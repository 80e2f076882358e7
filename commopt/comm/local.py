"""A world of one: every collective is the identity. For single-process runs and tests.

>>> import torch
>>> from commopt.comm.local import LocalCommunicator
>>> comm = LocalCommunicator()
>>> out = torch.empty(3)
>>> comm.allgather(torch.arange(3.0), out)
>>> out.tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import torch

from commopt.comm.base import Communicator, CompletedWork, Work

_DONE = CompletedWork()


class LocalCommunicator(Communicator):
    """Rank 0 of a world of size 1. All operations complete at once, on the caller's thread."""

    name = "local"

    def __init__(self, *, allreduce_grad_dtype: torch.dtype | None = None):
        super().__init__(allreduce_grad_dtype=allreduce_grad_dtype)
        self._init_topology()

    def _allreduce(self, buf: torch.Tensor) -> Work:
        return _DONE

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        if recv.data_ptr() != send.data_ptr():
            recv.copy_(send)
        return _DONE

    _allgather = _alltoall

    def _broadcast(self, buf: torch.Tensor, root: int) -> Work:
        return _DONE

    def _barrier(self) -> None:
        return None

    def _split(self, color: int, key: int) -> LocalCommunicator:
        return LocalCommunicator(allreduce_grad_dtype=self.allreduce_grad_dtype)

    def supports_sum(self, dtype: torch.dtype) -> bool:
        return True
