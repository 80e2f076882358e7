"""Error-feedback residuals across world sizes: where each residual key lies in its buffer, and
one rank's share of the residuals that the ranks of another world size saved.

Error feedback keeps, per key, what the codec has not sent yet, in the mean's units (each rank
adds its residual to its own term of the mean). Only the sum over ranks enters the mean, so
residuals saved by ``n`` ranks carry over to ``m`` ranks exactly when every element's sum is
kept: the sum over the saved ranks is taken element by element of the buffer, then handed to
this world's keys. The native plan's one key per buffer: a ``1/m`` share on every rank. The
scatter-reduce plan: each chunk's sum to the gather-stage key (``ag{k}``) of the rank that
owns the chunk, whose encode adds it to the chunk's reduced sum; its scatter-stage keys
(``rs{i}``) start at zero.

    >>> import torch
    >>> spans = residual_spans("scatter_reduce", rank=0, size=2, numel=10, alignment=4, key="b0")
    >>> spans
    {'b0/ag0': (0, 8), 'b0/rs1': (8, 10)}
    >>> saved = [{"b0/ag0": torch.ones(8), "b0/rs1": torch.ones(2)},
    ...          {"b0/rs0": torch.ones(8), "b0/ag0": torch.ones(2)}]
    >>> total = summed_residuals(saved, "b0", numel=10, alignment=4)
    >>> total.tolist()
    [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    >>> {k: v.tolist() for k, v in share(total, "native", rank=1, size=4, key="b0", alignment=4).items()}
    {'b0': [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]}

The keys of the hierarchical plan depend on the node layout, which a checkpoint does not
record, and the low-rank codec keeps its residuals per matrix with its own factors: neither is
carried over (:class:`NotReshardable` says which and why).
"""

from __future__ import annotations

import re

import torch

from commopt.collectives.layout import elements_per_piece, scatter_reduce_layout

__all__ = [
    "SAVED_BY_RANKS",
    "NotReshardable",
    "residual_spans",
    "share",
    "summed_residuals",
]

#: The key of a codec state that holds, instead of this rank's own state, the states every
#: rank of another world size saved (in rank order), for the reducer to reshard.
SAVED_BY_RANKS = "saved_by_ranks"

_SCATTER_REDUCE_KEY = re.compile(r"(rs|ag)\d+")


class NotReshardable(ValueError):
    """Residuals that cannot be carried to another world size; the message says why."""


def residual_spans(
    algorithm: str,
    *,
    rank: int,
    size: int,
    numel: int,
    alignment: int,
    key: str,
    piece_bytes: int | None = None,
    element_size: int = 4,
) -> dict[str, tuple[int, int]]:
    """``{residual key: (lo, hi)}``: the elements of a ``numel``-element buffer named ``key``
    whose residual each of ``rank``'s keys holds under ``algorithm`` (as
    :mod:`commopt.collectives.plans` cuts it). Raises :class:`NotReshardable` for the plans
    whose keys cannot be placed.

        >>> residual_spans("native", rank=1, size=2, numel=6, alignment=1, key="b3:6")
        {'b3:6': (0, 6)}
    """
    if algorithm == "native":
        return {key: (0, numel)}
    if algorithm == "scatter_reduce":
        layout = scatter_reduce_layout(
            numel, size, alignment, elements_per_piece(piece_bytes, element_size)
        )
        spans: dict[str, tuple[int, int]] = {}
        for k, chunks in enumerate(layout):
            for j, (lo, hi) in enumerate(chunks):
                if hi > lo:  # empty chunks are never encoded
                    name = f"ag{k}" if j == rank else f"rs{k * size + j}"
                    spans[f"{key}/{name}"] = (lo, hi)
        return spans
    if algorithm == "hierarchical":
        raise NotReshardable(
            "the hierarchical plan's residual keys depend on the node layout, which a "
            "checkpoint does not record"
        )
    if algorithm == "identity":
        raise NotReshardable("a world of one sends nothing through the codec")
    raise NotReshardable(f"the {algorithm} plan's residuals are not kept per element")


def _saved_algorithm(keys: set[str], key: str) -> str:
    """The plan that wrote ``keys`` (all of one buffer ``key``), from their names."""
    if keys == {key}:
        return "native"
    tails = {k[len(key) + 1 :] for k in keys if k != key}
    if key not in keys and all(_SCATTER_REDUCE_KEY.fullmatch(t) for t in tails):
        return "scatter_reduce"
    if any(t.startswith("x") for t in tails):
        return "hierarchical"
    raise NotReshardable(f"residual keys {sorted(keys)} are of no plan this commopt knows")


def summed_residuals(
    saved: list[dict[str, torch.Tensor]],
    key: str,
    *,
    numel: int,
    alignment: int,
    piece_bytes: int | None = None,
) -> torch.Tensor | None:
    """The residuals of buffer ``key`` that every rank saved (``saved[r]``: rank r's residuals,
    all keys), summed element by element into one fp32 tensor of ``numel`` elements; None when
    no rank kept one. :class:`NotReshardable` when the keys cannot be placed."""
    size = len(saved)
    total: torch.Tensor | None = None
    for rank, residuals in enumerate(saved):
        mine = {k: v for k, v in residuals.items() if k == key or k.startswith(f"{key}/")}
        if not mine:
            continue
        spans = residual_spans(
            _saved_algorithm(set(mine), key),
            rank=rank,
            size=size,
            numel=numel,
            alignment=alignment,
            key=key,
            piece_bytes=piece_bytes,
        )
        if total is None:
            total = torch.zeros(numel, dtype=torch.float32)
        for k, value in mine.items():
            lo, hi = spans.get(k, (0, -1))
            if value.numel() != hi - lo:
                raise NotReshardable(
                    f"rank {rank}'s residual {k!r} ({value.numel()} elements) is not where "
                    f"{size} ranks cut a buffer of {numel} elements (saved by another version "
                    f"or with other settings)"
                )
            total[lo:hi] += value.detach().to("cpu", torch.float32).reshape(-1)
    return total


def share(
    total: torch.Tensor,
    algorithm: str,
    *,
    rank: int,
    size: int,
    key: str,
    alignment: int,
    piece_bytes: int | None = None,
) -> dict[str, torch.Tensor]:
    """``rank``'s residuals, of ``size`` ranks running ``algorithm``, such that their sum over
    the ranks is ``total`` (from :func:`summed_residuals`) at every element."""
    spans = residual_spans(
        algorithm,
        rank=rank,
        size=size,
        numel=total.numel(),
        alignment=alignment,
        key=key,
        piece_bytes=piece_bytes,
    )
    if algorithm == "native":
        return {key: total / size}
    # scatter_reduce: each chunk's sum goes to its owner's gather-stage key.
    return {
        k: total[lo:hi].clone()
        for k, (lo, hi) in spans.items()
        if k.rsplit("/", 1)[1].startswith("ag")
    }
