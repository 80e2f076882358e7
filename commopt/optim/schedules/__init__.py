"""Reduction schedules, chosen by name: when a step's gradients are sent, which step applies them.

Every schedule implements :class:`~commopt.optim.schedules.protocol.Schedule`, the one
interface the optimizer talks to (:mod:`commopt.optim.schedules.protocol`). The registry
below maps each name to the class that implements it; a schedule's module is imported when
the name is first used. Adding a schedule is one new module here, its tests and one line in
:data:`SCHEDULES` (CONTRIBUTING.md, "How to add a schedule"); :func:`register_schedule`
adds one at run time (tests, or a schedule kept outside commopt).

    >>> names()[:3]
    ['synchronous', 'stale', 'compensated']
    >>> schedule_class("stale").num_buffers
    2
    >>> schedule_name(False), schedule_name("compensated")
    ('synchronous', 'compensated')
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SCHEDULES",
    "names",
    "register_schedule",
    "schedule_class",
    "schedule_name",
]

#: name -> "module:class". One line per schedule.
SCHEDULES: dict[str, str] = {
    "synchronous": "commopt.optim.schedules.synchronous:SynchronousSchedule",
    "stale": "commopt.optim.schedules.double_buffered:DoubleBufferedSchedule",
    "compensated": "commopt.optim.schedules.double_buffered:CompensatedSchedule",
    "local_steps": "commopt.optim.schedules.local_steps:LocalStepsSchedule",
}

#: The schedule each ``double_buffering=`` value names (the wrapper's argument, a group's or a
#: rule's key); ``schedule=`` names any registered schedule.
DOUBLE_BUFFERING: dict[object, str] = {
    False: "synchronous",
    True: "compensated",
    "stale": "stale",
    "compensated": "compensated",
}

_loaded: dict[str, type] = {}


def names() -> list[str]:
    """The registered schedules' names, in registration order."""
    return list(SCHEDULES)


def register_schedule(name: str, cls: type | str) -> None:
    """Register ``cls`` (a class, or ``"module:class"``) under ``name``; a name is taken once."""
    if name in SCHEDULES:
        raise ValueError(f"a schedule named {name!r} is registered already")
    if not isinstance(cls, str):
        _loaded[name] = cls
        cls = f"{cls.__module__}:{cls.__qualname__}"
    SCHEDULES[name] = cls


def unregister_schedule(name: str) -> None:
    """Forget ``name`` (tests that registered a schedule of their own)."""
    SCHEDULES.pop(name, None)
    _loaded.pop(name, None)


def schedule_class(name: str) -> Any:
    """The class registered under ``name`` (its module imported on first use)."""
    cls = _loaded.get(name)
    if cls is not None:
        return cls
    where = SCHEDULES.get(name)
    if where is None:
        raise ValueError(f"unknown schedule {name!r}; the schedules are {', '.join(SCHEDULES)}")
    module, _, attr = where.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    _loaded[name] = cls
    return cls


def schedule_name(double_buffering: object) -> str:
    """The schedule a ``double_buffering=`` value names.

    ``False``: ``"synchronous"``; ``True``: ``"compensated"`` (with its default rule: it keeps
    synchronous training's accuracy); ``"stale"`` (ChainerMN's plain double buffering) and
    ``"compensated"``: themselves.
    """
    key = double_buffering
    if not isinstance(key, str):
        key = bool(key)
    try:
        return DOUBLE_BUFFERING[key]
    except (KeyError, TypeError):
        raise ValueError(
            "double_buffering must be False, True, 'stale' or 'compensated', got "
            f"{double_buffering!r}"
        ) from None
