"""Replicas start equal: the same-model check and the broadcast from rank 0.

Run when a MultiNodeOptimizer is created and whenever its parameters change: every rank
must hold the same parameters (else averaging their gradients is meaningless, and the
error names the ranks and tensors that differ), and every rank starts from rank 0's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from commopt.comm.base import Communicator

__all__ = [
    "ModelMismatchError",
    "average_replicas",
    "broadcast_from_root",
    "check_same_model",
    "param_names",
]


class ModelMismatchError(ValueError):
    """The ranks' optimizers (models) do not hold the same parameters."""


def param_names(param_groups: Sequence[dict[str, Any]], model: torch.nn.Module | None) -> list[str]:
    """``model``'s names of the parameters in ``param_groups`` (what errors and the compression
    policy use), else their positions.

        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> groups = [{"params": [model.weight]}, {"params": [model.bias, torch.zeros(1)]}]
        >>> param_names(groups, model)
        ['weight', 'bias', "param_groups[1]['params'][1]"]
    """
    by_id = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    return [
        by_id.get(id(p), f"param_groups[{gi}]['params'][{pi}]")
        for gi, g in enumerate(param_groups)
        for pi, p in enumerate(g["params"])
    ]


def check_same_model(
    comm: Communicator,
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    model: torch.nn.Module | None = None,
) -> None:
    """Raise :class:`ModelMismatchError`, naming every rank that differs, unless every rank
    holds the same parameters (and ``model``'s buffers): names, shapes, dtypes, requires_grad.

    A collective call (an object allgather of those descriptions, never of tensor data).

        >>> import torch, commopt
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> check_same_model(commopt.create_communicator("local"), [w], ["w"])
    """
    mine = [
        (names[i], tuple(p.shape), str(p.dtype), bool(p.requires_grad))
        for i, p in enumerate(params)
    ]
    if model is not None:
        mine += [
            (f"buffer {n}", tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()
        ]
    everyone = comm.allgather_obj(mine)
    problems = []
    ref = everyone[0]
    for r, theirs in enumerate(everyone[1:], start=1):
        if len(theirs) != len(ref):
            k = next(
                (i for i, (a, b) in enumerate(zip(ref, theirs)) if a != b),
                min(len(ref), len(theirs)),
            )
            at = ref[k] if k < len(ref) else theirs[k]
            problems.append(
                f"rank {r} has {len(theirs)} parameters/buffers but rank 0 has "
                f"{len(ref)}; first difference at {at[0]!r}"
            )
            continue
        for a, b in zip(ref, theirs):
            if a != b:
                what = (
                    "shape"
                    if a[1] != b[1]
                    else "dtype"
                    if a[2] != b[2]
                    else "requires_grad"
                    if a[3] != b[3]
                    else "name"
                )
                alias = f" (rank 0 calls it {a[0]!r})" if a[0] != b[0] and what != "name" else ""
                problems.append(
                    f"rank {r}: parameter {b[0]!r} has {what} "
                    f"{_field(b, what)} but rank 0 has {_field(a, what)}{alias}"
                )
                break
    if problems:
        raise ModelMismatchError(
            "the ranks' models differ, so their gradients cannot be averaged: "
            + "; ".join(problems)
            + ". Build the same model on every rank (same architecture and parameter order)."
        )


@torch.no_grad()
def broadcast_from_root(
    comm: Communicator, params: Sequence[torch.Tensor], model: torch.nn.Module | None = None
) -> None:
    """Rank 0's parameters (and ``model``'s parameters and buffers) to every rank, in place.

    One flat message per (device, dtype), so a model of many small tensors costs a few
    collectives, not one per tensor.

        >>> import torch, commopt
        >>> w = torch.ones(3)
        >>> broadcast_from_root(commopt.create_communicator("local"), [w]); w.tolist()
        [1.0, 1.0, 1.0]
    """
    tensors = list(params)
    if model is not None:
        seen = {id(t) for t in tensors}
        tensors += [
            t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in seen
        ]
    _per_flat(tensors, lambda flat: comm.broadcast(flat, root=0))


def _per_flat(tensors: Sequence[torch.Tensor], collective: Any) -> None:
    """Run ``collective`` in place on one flat copy of ``tensors`` per (device, dtype), and
    copy the results back: a model of many small tensors costs a few collectives."""
    groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((str(t.device), t.dtype), []).append(t)
    with torch.no_grad():
        for group in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            collective(flat)
            offset = 0
            for t in group:
                n = t.numel()
                t.detach().copy_(flat[offset : offset + n].view_as(t))
                offset += n


def _field(sig: tuple[Any, ...], what: str) -> Any:
    return {"shape": sig[1], "dtype": sig[2], "requires_grad": sig[3], "name": sig[0]}[what]


def average_replicas(
    comm: Communicator, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer
) -> None:
    """Bring replicas that trained apart to one: every rank's ``params`` become their mean
    over the ranks, and ``inner``'s state of them rank 0's (a collective call; a
    floating-point parameter is averaged, any other taken from rank 0).

        >>> import torch, commopt
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.Adam([w])
        >>> average_replicas(commopt.create_communicator("local"), [w], opt); w.tolist()
        [1.0, 1.0]
    """

    def mean(flat: torch.Tensor) -> None:
        comm.allreduce(flat)
        flat.div_(comm.size)

    _per_flat([p for p in params if p.dtype.is_floating_point], mean)
    state = [
        v
        for p in params
        for _, v in sorted(inner.state.get(p, {}).items())
        if isinstance(v, torch.Tensor)
    ]
    others = [p for p in params if not p.dtype.is_floating_point]
    broadcast_from_root(comm, [*others, *state])
