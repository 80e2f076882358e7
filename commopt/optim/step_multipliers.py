"""Steps to the target relative to fp32: the table ``compression="auto"`` prices its options with.

Each option (a codec, a schedule, local steps with ``H`` steps between averages) has a *step
multiplier*: the steps it needs to reach the validation loss fp32 reaches, divided by fp32's.
The table is package data (``step_multipliers.json`` beside this module). Its measured
entries come from the time-to-accuracy benchmark's result files, and
``commopt bench to_accuracy --from-json RESULT.json ... --write-multipliers PATH`` rewrites
it from them (docs/optimizer.md); entries no result file measures keep their estimate and
say where it comes from.

    >>> table = StepMultipliers.load()
    >>> table.codec("none"), table.schedule("synchronous")
    (1.0, 1.0)
    >>> table.codec("qsgd4+ef") >= 1.0
    True
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TABLE_PATH", "StepMultipliers"]

#: The table shipped with the package.
TABLE_PATH = Path(__file__).with_name("step_multipliers.json")


@dataclass(frozen=True)
class StepMultipliers:
    """The table: ``codecs`` and ``schedules`` map a name to an entry with its
    ``multiplier`` (local steps as ``"local_steps:H"``); ``outer_codecs`` the codecs that may
    carry local steps' outer gradients, each with its multiplier against exact outer
    gradients at the same ``H`` (a codec missing there is no candidate for them). A multiplier
    below 1 (a measurement's noise: fewer steps than fp32) counts as 1."""

    codecs: dict[str, float]
    schedules: dict[str, float]
    outer_codecs: dict[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path | None = None) -> StepMultipliers:
        """The table at ``path`` (default: the package's); a ValueError names what is wrong."""
        path = TABLE_PATH if path is None else Path(path)
        try:
            data = json.loads(path.read_text())
            return cls.from_dict(data)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(
                f"cannot read the step multipliers at {path} ({err}): regenerate it with "
                "`commopt bench to_accuracy --from-json RESULT.json --write-multipliers PATH`"
            ) from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepMultipliers:
        def section(name: str) -> dict[str, float]:
            out = {}
            for key, entry in data[name].items():
                value = float(entry["multiplier"])
                if not (value > 0 and math.isfinite(value)):
                    raise ValueError(f"{name}.{key}: the multiplier must be > 0, got {value}")
                out[str(key)] = max(1.0, value)
            return out

        return cls(
            codecs=section("codecs"),
            schedules=section("schedules"),
            outer_codecs=section("outer_codecs") if "outer_codecs" in data else {},
        )

    def codec(self, option: str) -> float:
        """``option``'s multiplier (1 for the exact ``none``; an option missing from the
        table is a ValueError: the planner never guesses)."""
        if option == "none":
            return 1.0
        if option not in self.codecs:
            raise ValueError(
                f"the step multipliers have no entry for the codec {option!r}: add one to "
                f"{TABLE_PATH.name} (measured, or an estimate with its source)"
            )
        return self.codecs[option]

    def schedule(self, name: str) -> float:
        """A per-step schedule's multiplier (1 for ``synchronous``; 1 for a schedule missing
        from the table, which the log then names as unpriced)."""
        return 1.0 if name == "synchronous" else self.schedules.get(name, 1.0)

    def local_steps(self, h: int) -> float | None:
        """Local steps with ``h`` steps between averages: the table's entry, else the
        interpolation in log2(h) between the two entries around it (None beyond them: not
        priced, so not a candidate)."""
        known = sorted(
            (int(k.split(":", 1)[1]), v)
            for k, v in self.schedules.items()
            if k.startswith("local_steps:")
        )
        if h <= 1:
            return 1.0
        for (h0, m0), (h1, m1) in zip([(1, 1.0), *known], known):
            if h0 <= h <= h1:
                if h == h1:
                    return m1
                t = (math.log2(h) - math.log2(h0)) / (math.log2(h1) - math.log2(h0))
                return m0 + t * (m1 - m0)
        return None

    def outer_codec(self, option: str) -> float | None:
        """``option``'s multiplier on local steps' outer gradients, against exact ones (1 for
        ``none``; None: the table neither measures nor estimates it, so the planner does not
        offer it for outer gradients).

            >>> table = StepMultipliers.load()
            >>> table.outer_codec("none"), table.outer_codec("powersgd4") is None
            (1.0, True)
        """
        if option == "none":
            return 1.0
        return self.outer_codecs.get(option)

    def as_inputs(self) -> dict[str, float]:
        """The table as flat ``inputs`` of a plan (``multiplier.NAME``)."""
        return {
            **{f"multiplier.{k}": v for k, v in sorted(self.codecs.items())},
            **{f"multiplier.schedule.{k}": v for k, v in sorted(self.schedules.items())},
            **{f"multiplier.outer.{k}": v for k, v in sorted(self.outer_codecs.items())},
        }
