"""The default rule: which parameters a schedule that predicts or delays leaves synchronous.

Under compensated double buffering (``double_buffering=True`` or ``"compensated"``) the
weights of ``nn.Embedding`` modules, the parameters tied to them (the same tensor), and the
1-D parameters (biases, normalisation scales) reduce synchronously unless a ``plans=`` rule
or the parameter group says otherwise: the embedding rows carry the most per-replica jitter,
and the 1-D tensors cost little to send (docs/optimizer.md). The schedule declares it
(``synchronous_by_default``); its options ``synchronous_embeddings`` and
``synchronous_vectors`` turn the parts off.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["default_synchronous", "embedding_params", "vector_params"]


def embedding_params(model: torch.nn.Module | None) -> set[int]:
    """The ids of ``model``'s ``nn.Embedding`` weights (a tied parameter is the same tensor).

    >>> model = torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.Linear(2, 5))
    >>> model[1].weight = model[0].weight  # tied output projection
    >>> embedding_params(model) == {id(model[0].weight)}
    True
    """
    if model is None:
        return set()
    return {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}


def vector_params(params: Iterable[torch.Tensor]) -> set[int]:
    """The ids of the 1-D (and 0-D) parameters among ``params``: biases, normalisation scales.

    >>> layer = torch.nn.Linear(3, 2)
    >>> vector_params(layer.parameters()) == {id(layer.bias)}
    True
    """
    return {id(p) for p in params if p.dim() <= 1}


def default_synchronous(
    model: torch.nn.Module | None,
    params: Iterable[torch.Tensor],
    *,
    embeddings: bool = True,
    vectors: bool = True,
) -> set[int]:
    """The ids of the parameters the default rule reduces synchronously: ``model``'s
    embedding tables (:func:`embedding_params`) and the 1-D ``params``
    (:func:`vector_params`), each part where its flag is on.

    >>> model = torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.Linear(2, 5))
    >>> ids = default_synchronous(model, model.parameters())
    >>> ids == {id(model[0].weight), id(model[1].bias)}
    True
    >>> default_synchronous(model, model.parameters(), vectors=False) == {id(model[0].weight)}
    True
    """
    ids = embedding_params(model) if embeddings else set()
    if vectors:
        ids |= vector_params(params)
    return ids
