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
from typing import Any

from commopt.comm.errors import CollectiveMismatchError, CommError

# torch is imported on first use, not here: `commopt launch` reads commopt.comm.launcher and
# must start (and take Ctrl-C) without paying for, or being interrupted inside, import torch.
_LAZY = {
    "Communicator": "commopt.comm.base",
    "CompletedWork": "commopt.comm.base",
    "Work": "commopt.comm.base",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'commopt.comm' has no attribute {name!r}")


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

_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def communicator_names() -> list[str]:
    return sorted(_BACKENDS)


def parse_dtype(value: Any) -> Any:
    """``None``, a torch dtype, a NumPy dtype or one of the names float32/float16/bfloat16."""
    import torch

    allowed = {n: getattr(torch, t) for n, t in _DTYPE_NAMES.items()}
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in allowed.values():
            raise ValueError(
                f"allreduce_grad_dtype must be float32, float16 or bfloat16, got {value}"
            )
        return value
    name = getattr(value, "name", None) or str(value)
    name = name.replace("torch.", "").replace("numpy.", "")
    if name not in allowed:
        raise ValueError(
            f"unknown allreduce_grad_dtype {value!r}: use one of float32, float16, bfloat16 (or None)"
        )
    return allowed[name]


def create_communicator(
    name: str = "mpi", *, allreduce_grad_dtype=None, timeout: float | str | None = None, **options
):
    """Create the communicator called ``name``; ``options`` go to its constructor.

    ``allreduce_grad_dtype`` ("float16", "bfloat16", "float32" or a torch dtype) is the
    dtype gradients travel in by default (create_multi_node_optimizer reads it).
    ``timeout``: seconds a collective may go without progress before the job ends with an
    error naming the silent peers (default $COMMOPT_COMM_TIMEOUT, else 600; 0 or "off": no
    bound). See :mod:`commopt.comm.timeout` and docs/reliability.md for what each
    transport counts as progress.
    """
    key = _ALIASES.get(name, name)
    if key not in _BACKENDS:
        raise ValueError(
            f"unknown communicator {name!r}; valid names: {', '.join(communicator_names())}"
        )
    from commopt.comm.timeout import comm_timeout

    comm_timeout(timeout)  # a bad value (argument or environment) fails here, for every backend
    if timeout is not None and key != "local":
        options["timeout"] = timeout
    module_name, class_name = _BACKENDS[key]
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name)
    comm = cls(allreduce_grad_dtype=parse_dtype(allreduce_grad_dtype), **options)
    if key != "local":
        _check_world_matches_launcher(comm, name)
    return comm


def _check_world_matches_launcher(comm, name: str) -> None:
    """A world of one where the launcher started N ranks means N separate one-rank jobs.

    That is what the ``mpi`` communicator sees under torchrun (MPI knows nothing of torchrun's
    processes): every process would train alone and silently. Refuse, naming the fix.
    """
    from commopt.comm.launcher import detect_launcher

    info = detect_launcher()
    if comm.size != 1 or info.size <= 1:
        return
    fits = "torch" if info.name == "torchrun" else "mpi" if info.is_mpi else None
    use = [n for n in (fits, "auto") if n and (n in _BACKENDS or n in _ALIASES) and n != name]
    hint = (
        " or ".join(f"create_communicator({n!r})" for n in use) or "a communicator of this launcher"
    )
    comm.finalize()
    raise CommError(
        f"rank {info.rank}: the {name!r} communicator sees a world of one, but {info.name} "
        f"started {info.size} processes (its environment says rank {info.rank} of {info.size}): "
        f"each would train alone. Under {info.name} use {hint}, or start the job with "
        f"the launcher this communicator needs (mpirun or `commopt launch` for 'mpi')."
    )


__all__ = [
    "CollectiveMismatchError",
    "CommError",
    "Communicator",
    "CompletedWork",
    "Work",
    "communicator_names",
    "create_communicator",
    "parse_dtype",
]
