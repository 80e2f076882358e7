"""commopt's phases as ``torch.profiler`` ranges: where a step's communication time goes.

Every bucket's way to the average is marked with ranges named ``commopt.<phase>``:

``commopt.pack``       gradients copied into the bucket (and its local NaN/Inf flag)
``commopt.encode``     a codec compressing a bucket, a chunk or a piece onto the wire
``commopt.transport``  a collective handed to the transport (mpi, gloo, NCCL, Horovod)
``commopt.wait``       waiting for a collective, or for a whole step's reduction
``commopt.decode``     a codec turning wire bytes back into (summed) values
``commopt.agree``      the step's trailer: every rank agrees on NaN/Inf and presence
``commopt.unpack``     the averages handed to ``param.grad``

They show in TensorBoard and Chrome traces like any ``record_function`` range. Host-ordered
transports run the collectives on commopt's own thread (``commopt-collectives``);
``torch.profiler`` records other threads only when asked to, which :func:`profile` does:

    >>> import torch, commopt
    >>> from commopt import profiling
    >>> with profiling.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    ...     with profiling.phase("pack"):
    ...         _ = torch.ones(4).sum()
    >>> "commopt.pack" in {e.name for e in prof.events()}
    True

With no profiler running a phase costs one attribute read (no range is created).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["PHASES", "phase", "profile"]

PHASES = ("pack", "encode", "transport", "wait", "decode", "agree", "unpack")

_OFF = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """The range ``commopt.<name>`` while a profiler runs; a no-op otherwise."""
    # torch's own fast check (a module flag its profilers set on start and clear on stop).
    if not getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return _OFF
    return torch.profiler.record_function(f"commopt.{name}")


def profile(**kwargs: Any) -> torch.profiler.profile:
    """``torch.profiler.profile(**kwargs)`` that also records commopt's collectives thread.

    Sets ``experimental_config`` to one with ``profile_all_threads=True`` unless given.
    """
    if "experimental_config" not in kwargs:
        from torch._C._profiler import _ExperimentalConfig

        kwargs["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
    return torch.profiler.profile(**kwargs)
