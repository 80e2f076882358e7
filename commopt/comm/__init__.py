"""Transports, chosen by name and imported only when chosen.

    >>> import commopt
    >>> comm = commopt.create_communicator("local", allreduce_grad_dtype="float16")
    >>> comm.rank, comm.size, comm.allreduce_grad_dtype
    (0, 1, torch.float16)

=============  ==============================================  ===========================
name           transport                                       needs
=============  ==============================================  ===========================
``mpi``        mpi4py (CPU zero-copy; CUDA staged or aware)    ``pip install commopt[mpi]``
``pure_nccl``  NCCL through CuPy, bootstrapped over MPI        ``pip install commopt[nccl]``
``torch``      torch.distributed process group (gloo/nccl)     (torch)
``horovod``    horovod.torch                                   ``make horovod``
``local``      a world of one                                  (nothing)
=============  ==============================================  ===========================
"""
from __future__ import annotations

import importlib

import torch

from commopt.comm.base import Communicator, CompletedWork, Work
from commopt.comm.errors import CollectiveMismatchError, CommError

# name -> (module, class). Modules are imported only when their name is asked for, so an
# optional dependency that is missing affects only its own backend.
_BACKENDS = {
    "mpi": ("commopt.comm.mpi", "MPICommunicator"),
    "pure_nccl": ("commopt.comm.nccl", "NcclCommunicator"),
    "torch": ("commopt.comm.torch_dist", "TorchCommunicator"),
    "horovod": ("commopt.comm.horovod", "HorovodCommunicator"),
    "local": ("commopt.comm.local", "LocalCommunicator"),
}
_ALIASES = {"nccl": "pure_nccl", "gloo": "torch", "naive": "mpi", "single": "local"}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def communicator_names() -> list[str]:
    return sorted(_BACKENDS)


def parse_dtype(value) -> torch.dtype | None:
    """``None``, a torch dtype, a NumPy dtype or one of the names float32/float16/bfloat16."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in _DTYPES.values():
            raise ValueError(f"allreduce_grad_dtype must be float32, float16 or bfloat16, got {value}")
        return value
    name = getattr(value, "name", None) or str(value)
    name = name.replace("torch.", "").replace("numpy.", "")
    if name not in _DTYPES:
        raise ValueError(
            f"unknown allreduce_grad_dtype {value!r}: use one of float32, float16, bfloat16 (or None)"
        )
    return _DTYPES[name]


def create_communicator(name: str = "mpi", *, allreduce_grad_dtype=None, **options) -> Communicator:
    """Create the communicator called ``name``; ``options`` go to its constructor.

    ``allreduce_grad_dtype`` ("float16", "bfloat16", "float32" or a torch dtype) is the
    dtype gradients travel in by default (create_multi_node_optimizer reads it).
    """
    key = _ALIASES.get(name, name)
    if key not in _BACKENDS:
        raise ValueError(
            f"unknown communicator {name!r}; valid names: {', '.join(communicator_names())}"
        )
    module_name, class_name = _BACKENDS[key]
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name)
    return cls(allreduce_grad_dtype=parse_dtype(allreduce_grad_dtype), **options)


__all__ = [
    "Communicator", "Work", "CompletedWork", "CommError", "CollectiveMismatchError",
    "create_communicator", "communicator_names", "parse_dtype",
]
