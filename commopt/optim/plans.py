"""Per-group plans: which codec and which schedule reduce each parameter.

A *plan* is the pair (``compression``, ``double_buffering``) that reduces a parameter. The
wrapper's arguments are the default plan; a parameter group of the inner optimizer may set
either key for its parameters (torch's idiom for per-group options), and the ``plans=``
rule list sets them by parameter name (``fnmatch`` patterns against the names of
``model.named_parameters()``, the first matching rule wins). A group's own keys win over
the rules, the rules over the wrapper's arguments.

The default rule: under ``double_buffering="compensated"`` the weights of ``nn.Embedding``
modules, and the parameters tied to them (the same tensor), and the 1-D parameters (biases,
normalisation scales) reduce synchronously, unless a rule or the group says otherwise
(:func:`default_synchronous`; the wrapper's
``synchronous_embeddings=False`` and ``synchronous_vectors=False`` turn its parts off).

    >>> import torch
    >>> a, b = torch.zeros(2), torch.zeros(3)
    >>> groups = [{"params": [a]}, {"params": [b], "double_buffering": True}]
    >>> rules = check_rules([("emb*", {"compression": "fp16"})])
    >>> [str(p) for p in param_plans(groups, ["emb.weight", "fc.weight"], "qsgd4", False, rules)]
    ['compression=fp16, double_buffering=False', 'compression=qsgd4, double_buffering=True']
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from commopt.codecs.base import Codec
from commopt.optim.compensation import parse_mode

__all__ = [
    "PLAN_KEYS",
    "Plan",
    "check_rules",
    "default_synchronous",
    "embedding_params",
    "group_plans",
    "param_plans",
    "vector_params",
]

#: The keys of a parameter group (or of a ``plans=`` rule) that choose a plan.
PLAN_KEYS = ("compression", "double_buffering")


def _compression_text(compression: Codec | str | None) -> str:
    if compression is None:
        return "None"
    if isinstance(compression, str):
        return compression.strip().lower()
    if isinstance(compression, Codec):
        return repr(compression)
    raise TypeError(
        f"compression must be a commopt Codec, a codec name such as 'qsgd4', or None, got "
        f"{type(compression).__name__}"
    )


@dataclass(frozen=True)
class Plan:
    """How one parameter's gradients are reduced: its codec and its schedule."""

    compression: Codec | str | None = field(compare=False, hash=False)
    double_buffering: bool | str
    compression_text: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression_text", _compression_text(self.compression))
        on, compensated = parse_mode(self.double_buffering)
        object.__setattr__(self, "double_buffering", "compensated" if compensated else on)

    def __str__(self) -> str:
        return f"compression={self.compression_text}, double_buffering={self.double_buffering}"


def check_rules(rules: Sequence | None) -> list[tuple[str, dict[str, Any]]]:
    """The ``plans=`` argument checked: ``[(pattern, {"compression": ..., ...}), ...]``."""
    if rules is None:
        return []
    checked = []
    for i, rule in enumerate(rules):
        if (
            not isinstance(rule, (tuple, list))
            or len(rule) != 2
            or not isinstance(rule[0], str)
            or not isinstance(rule[1], dict)
        ):
            raise TypeError(
                f"plans[{i}] must be a (pattern, options) pair such as "
                f"('embed*', {{'double_buffering': False}}), got {rule!r}"
            )
        unknown = sorted(set(rule[1]) - set(PLAN_KEYS))
        if unknown:
            raise ValueError(
                f"plans[{i}] sets {', '.join(unknown)}: a rule may set only "
                f"{' and '.join(PLAN_KEYS)}"
            )
        Plan(rule[1].get("compression"), rule[1].get("double_buffering", False))  # checks values
        checked.append((rule[0], dict(rule[1])))
    return checked


def embedding_params(model) -> set[int]:
    """The ids of ``model``'s ``nn.Embedding`` weights (a tied parameter is the same tensor).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.Linear(2, 5))
    >>> model[1].weight = model[0].weight  # tied output projection
    >>> embedding_params(model) == {id(model[0].weight)}
    True
    """
    import torch

    if model is None:
        return set()
    return {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}


def vector_params(params) -> set[int]:
    """The ids of the 1-D (and 0-D) parameters among ``params``: biases, normalisation scales.

    >>> import torch
    >>> layer = torch.nn.Linear(3, 2)
    >>> vector_params(layer.parameters()) == {id(layer.bias)}
    True
    """
    return {id(p) for p in params if p.dim() <= 1}


def default_synchronous(
    model, params, *, embeddings: bool = True, vectors: bool = True
) -> set[int]:
    """The ids of the parameters the default rule reduces synchronously: ``model``'s
    embedding tables (:func:`embedding_params`) and the 1-D ``params``
    (:func:`vector_params`), each part where its flag is on.

    >>> import torch
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


def param_plans(
    param_groups: Sequence[dict],
    names: Sequence[str],
    compression: Codec | str | None,
    double_buffering: bool | str,
    rules: Sequence[tuple[str, dict[str, Any]]],
    synchronous: Collection[int] = frozenset(),
) -> list[Plan]:
    """The plan of every parameter of ``param_groups``, in their order (``names``: theirs).

    ``synchronous``: ids of parameters whose default is ``double_buffering=False`` (the
    default rule); a rule or the group's key still wins.
    """
    plans = []
    position = 0
    for group in param_groups:
        for param in group["params"]:
            options: dict[str, Any] = {
                "compression": compression,
                "double_buffering": False if id(param) in synchronous else double_buffering,
            }
            for pattern, chosen in rules:
                if fnmatch.fnmatchcase(names[position], pattern):
                    options.update(chosen)
                    break
            options.update({k: group[k] for k in PLAN_KEYS if k in group})
            plans.append(Plan(options["compression"], options["double_buffering"]))
            position += 1
    return plans


def group_plans(param_groups: Sequence[dict], plans: Sequence[Plan]) -> dict[str, str]:
    """Per group, the text of its parameters' plans (what every rank must share)."""
    out = {}
    position = 0
    for gi, group in enumerate(param_groups):
        n = len(group["params"])
        own = plans[position : position + n]
        position += n
        distinct = list(dict.fromkeys(str(p) for p in own))
        out[f"plan of parameter group {gi}"] = " | ".join(
            f"{text} x{sum(1 for p in own if str(p) == text)}" for text in distinct
        )
    return out
