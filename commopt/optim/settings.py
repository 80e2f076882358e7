"""The wrapper's settings: every argument of ``create_multi_node_optimizer``, written once.

:class:`Settings` is a frozen dataclass whose fields are the wrapper's arguments after the
inner optimizer and the communicator, in the same order and with the same defaults;
``create_multi_node_optimizer``'s and ``MultiNodeOptimizer``'s signatures are made from it
(:func:`signature`). Keyword arguments that are not fields are the schedules' own options
(``overlap`` of the synchronous schedule, ``synchronous_embeddings`` and
``synchronous_vectors`` of the compensated one, ...): each registered schedule declares
them (:mod:`commopt.optim.schedules`), and one no schedule declares is refused. Every rank's
fingerprint of the settings (:mod:`commopt.optim.fingerprint`) is built from this object.

    >>> s = Settings.of("compensated", compression="qsgd4", synchronous_vectors=False)
    >>> s.default_schedule, s.zero_fill, dict(s.schedule_options)
    ('compensated', True, {'synchronous_vectors': False})
    >>> Settings.of(overlapp=True)
    Traceback (most recent call last):
      ...
    TypeError: create_multi_node_optimizer() got an unexpected keyword argument 'overlapp' (its settings: ...; the schedules' options: overlap, ...)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from types import MappingProxyType
from typing import Any

from commopt.optim import schedules
from commopt.optim.schedules.protocol import option_names

__all__ = ["Settings", "signature"]


@dataclass(frozen=True)
class Settings:
    """The arguments of ``create_multi_node_optimizer`` after ``optimizer`` and ``comm``."""

    double_buffering: bool | str = False
    zero_fill: bool = True
    _: KW_ONLY
    schedule: str | None = None
    allreduce_grad_dtype: Any = None
    compression: Any = None
    bucket_cap_mb: float = 25
    policy: Any = None
    model: Any = field(default=None, compare=False)
    seed: int | None = None
    algorithm: str = "auto"
    clip_grad_norm: float | None = None
    plans: Sequence[Any] | None = None
    auto_link_rate: float | str | None = None
    auto_measure_steps: int = 3
    #: the keyword arguments the schedules declare (their options), as given
    schedule_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, *args: Any, **kwargs: Any) -> Settings:
        """The settings from the wrapper's arguments (a :class:`Settings` passes through)."""
        if len(args) == 1 and not kwargs and isinstance(args[0], Settings):
            return args[0]
        own = {f.name for f in dataclasses.fields(cls)} - {"schedule_options"}
        declared = option_names([schedules.schedule_class(n) for n in schedules.names()])
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
        unknown = [k for k in options if k not in declared]
        if unknown:
            raise TypeError(
                f"create_multi_node_optimizer() got an unexpected keyword argument "
                f"{unknown[0]!r} (its settings: {', '.join(_field_names())}; the schedules' "
                f"options: {', '.join(declared)})"
            )
        return cls(*args, **kwargs, schedule_options=MappingProxyType(options))

    @property
    def default_schedule(self) -> str:
        """The schedule of the default plan: ``schedule=``, else what ``double_buffering=`` names."""
        if self.schedule is None:
            return schedules.schedule_name(self.double_buffering)
        schedules.schedule_class(self.schedule)  # a registered name, or a ValueError naming them
        if self.double_buffering is not False:
            raise ValueError(
                f"schedule={self.schedule!r} and double_buffering={self.double_buffering!r}: "
                "pass one (double_buffering= names a schedule: False synchronous, True "
                "compensated, 'stale')"
            )
        return self.schedule

    def options_for(self, schedule: Any) -> Any:
        """``schedule``'s options: its declared defaults, with the ones given here."""
        names = {f.name for f in dataclasses.fields(schedule.options)}
        return schedule.options(**{k: v for k, v in self.schedule_options.items() if k in names})

    def option(self, name: str, default: Any) -> Any:
        """One schedule option as given (``default`` if not given)."""
        return self.schedule_options.get(name, default)


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Settings) if f.name != "schedule_options"]


def signature(*leading: str) -> inspect.Signature:
    """``(leading..., double_buffering=False, zero_fill=True, *, ..., overlap=True, ...,
    **schedule_options)``: the wrapper's signature, made from :class:`Settings` and the
    registered schedules' options (for ``help()``, editors and ``commopt simulate``'s check
    of a configuration's keys)."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in leading]
    for f in dataclasses.fields(Settings):
        if f.name == "schedule_options":
            continue
        kind = (
            inspect.Parameter.KEYWORD_ONLY if f.kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        default = f.default if f.default is not dataclasses.MISSING else None
        params.append(inspect.Parameter(f.name, kind, default=default))
    declared = option_names([schedules.schedule_class(n) for n in schedules.names()])
    for name, schedule in declared.items():  # the registered schedules' options
        default = next(f.default for f in dataclasses.fields(schedule.options) if f.name == name)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))
    params.append(inspect.Parameter("schedule_options", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)
