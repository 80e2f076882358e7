"""Which allreduce algorithm runs, and the checks on ``allreduce``'s arguments.

>>> import commopt
>>> from commopt.collectives.choice import choose_algorithm
>>> choose_algorithm(commopt.create_communicator("local"), None)
'identity'
"""

from __future__ import annotations

import torch

from commopt.codecs.base import Codec
from commopt.codecs.lowrank import PowerSGD
from commopt.comm.base import Communicator
from commopt.comm.topology import uniform_nodes

__all__ = ["ALGORITHMS", "check_arguments", "choose_algorithm", "native_ok"]

ALGORITHMS = ("auto", "native", "scatter_reduce", "hierarchical", "identity", "lowrank")


def native_ok(comm: Communicator, codec: Codec) -> bool:
    return (
        bool(codec.linear) and codec.wire_dtype is not None and comm.supports_sum(codec.wire_dtype)
    )


def choose_algorithm(comm: Communicator, codec: Codec | None) -> str:
    """The algorithm ``algorithm="auto"`` picks for this communicator and codec."""
    if comm.size == 1:
        return "identity"
    if isinstance(codec, PowerSGD):
        return "lowrank"
    if comm.inter_size > 1 and comm.intra_size > 1 and uniform_nodes(comm):
        return "hierarchical"
    if codec is None or native_ok(comm, codec):
        return "native"
    return "scatter_reduce"


def check_arguments(
    comm: Communicator, flat: torch.Tensor, codec: Codec | None, algorithm: str
) -> None:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("allreduce needs a contiguous 1-D tensor (flatten it first)")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if codec is not None:
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a commopt Codec or None, got {type(codec).__name__}")
        if flat.dtype != torch.float32:
            raise TypeError(f"codecs encode float32 buffers; got {flat.dtype} (use codec=None)")
    low_rank = isinstance(codec, PowerSGD)
    if isinstance(codec, PowerSGD) and algorithm not in ("auto", "lowrank", "identity"):
        raise ValueError(
            f"codec {codec.name} has its own plan: use algorithm='auto' or 'lowrank', "
            f"not {algorithm!r}"
        )
    if algorithm == "lowrank" and not low_rank:
        raise ValueError(
            "algorithm='lowrank' is the plan of the low-rank codecs (PowerSGD, 'powersgd4'); "
            f"codec {getattr(codec, 'name', codec)!r} is not one: use algorithm='auto'"
        )
    if algorithm == "native" and codec is not None and not native_ok(comm, codec):
        raise ValueError(
            f"algorithm='native' needs a linear codec whose wire dtype the transport sums; "
            f"codec {codec.name} (linear={codec.linear}, wire {codec.wire_dtype}) on "
            f"{type(comm).__name__}: use algorithm='scatter_reduce' or 'auto'"
        )
    if algorithm == "hierarchical" and not uniform_nodes(comm):
        raise ValueError(
            "algorithm='hierarchical' needs the same number of ranks on every node; "
            f"nodes here: {getattr(comm, 'node_names', '?')}. Use algorithm='auto'."
        )
