"""Per-group plans: which codec and which schedule reduce each parameter.

A *plan* is the pair (``compression``, schedule) that reduces a parameter; the schedule is
named (:mod:`commopt.optim.schedules`) by ``schedule=`` or by ``double_buffering=``
(``False``: synchronous, ``True``: compensated, ``"stale"``, ``"compensated"``). The
wrapper's arguments are the default plan; a parameter group of the inner optimizer may set
these keys for its parameters (torch's idiom for per-group options), and the ``plans=`` rule
list sets them by parameter name (``fnmatch`` patterns against the names of
``model.named_parameters()``, the first matching rule wins). A group's own keys win over the
rules, the rules over the wrapper's arguments.

The default rule (:mod:`~commopt.optim.default_rule`): the wrapper's default schedule may
leave some parameters to the synchronous schedule unless a rule or the group says otherwise
(compensated double buffering leaves the embedding tables and the 1-D tensors).

    >>> import torch
    >>> a, b = torch.zeros(2), torch.zeros(3)
    >>> groups = [{"params": [a]}, {"params": [b], "double_buffering": "stale"}]
    >>> rules = check_rules([("emb*", {"compression": "fp16"})])
    >>> [str(p) for p in param_plans(groups, ["emb.weight", "fc.weight"], Plan("qsgd4", False), rules)]
    ['compression=fp16, schedule=synchronous', 'compression=qsgd4, schedule=stale']
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from commopt.codecs.base import Codec
from commopt.optim import schedules
from commopt.optim.default_rule import default_synchronous, embedding_params, vector_params

__all__ = [
    "PLAN_KEYS",
    "Plan",
    "check_group",
    "check_rules",
    "default_synchronous",
    "embedding_params",
    "group_plans",
    "param_plans",
    "plan_key",
    "vector_params",
]

#: The keys of a parameter group (or of a ``plans=`` rule) that choose a plan.
PLAN_KEYS = ("compression", "double_buffering", "schedule")


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


def _schedule(value: object) -> str:
    """A registered schedule's name, or the one a ``double_buffering=`` value names."""
    if isinstance(value, str) and value in schedules.SCHEDULES:
        return value
    try:
        return schedules.schedule_name(value)
    except ValueError as err:
        raise ValueError(f"{err} (or schedule= one of {', '.join(schedules.names())})") from None


@dataclass(frozen=True)
class Plan:
    """How one parameter's gradients are reduced: its codec and its schedule (a registered
    name; a ``double_buffering=`` value is taken for the schedule it names)."""

    compression: Codec | str | None = field(compare=False, hash=False)
    schedule: str
    compression_text: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression_text", _compression_text(self.compression))
        object.__setattr__(self, "schedule", _schedule(self.schedule))

    def __str__(self) -> str:
        return f"compression={self.compression_text}, schedule={self.schedule}"


def plan_key(compression_text: str, schedule: str) -> str:
    """The text of a plan (its checkpoint key) from its parts."""
    return f"compression={compression_text}, schedule={schedule}"


def _chosen(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A group's or a rule's plan keys, ``double_buffering`` given as ``schedule``."""
    chosen = {k: options[k] for k in PLAN_KEYS if k in options}
    if "double_buffering" in chosen:
        if "schedule" in chosen:
            raise ValueError(
                f"{where} sets both schedule and double_buffering: set one (double_buffering="
                "names a schedule: False synchronous, True compensated, 'stale')"
            )
        chosen["schedule"] = chosen.pop("double_buffering")
    return chosen


def check_group(group: Mapping[str, Any], where: str) -> None:
    """Refuse a parameter group whose plan keys name no codec or no schedule (before it is
    added to the inner optimizer)."""
    chosen = _chosen(group, where)
    Plan(chosen.get("compression"), chosen.get("schedule", False))


def check_rules(rules: Sequence[Any] | None) -> list[tuple[str, dict[str, Any]]]:
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
                f"plans[{i}] sets {', '.join(unknown)}: a rule may set only {', '.join(PLAN_KEYS)}"
            )
        chosen = _chosen(rule[1], f"plans[{i}]")
        Plan(chosen.get("compression"), chosen.get("schedule", False))  # checks the values
        checked.append((rule[0], chosen))
    return checked


def param_plans(
    param_groups: Sequence[dict[str, Any]],
    names: Sequence[str],
    default: Plan,
    rules: Sequence[tuple[str, dict[str, Any]]],
    synchronous: Collection[int] = frozenset(),
) -> list[Plan]:
    """The plan of every parameter of ``param_groups``, in their order (``names``: theirs).

    ``synchronous``: ids of parameters whose default schedule is the synchronous one (the
    default rule); a rule or the group's key still wins.
    """
    plans = []
    position = 0
    for gi, group in enumerate(param_groups):
        own = _chosen(group, f"parameter group {gi}")
        for param in group["params"]:
            options: dict[str, Any] = {
                "compression": default.compression,
                "schedule": "synchronous" if id(param) in synchronous else default.schedule,
            }
            for pattern, chosen in rules:
                if fnmatch.fnmatchcase(names[position], pattern):
                    options.update(chosen)
                    break
            options.update(own)
            plans.append(Plan(options["compression"], options["schedule"]))
            position += 1
    return plans


def group_plans(param_groups: Sequence[dict[str, Any]], plans: Sequence[Plan]) -> dict[str, str]:
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
