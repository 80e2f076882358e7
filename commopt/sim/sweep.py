"""Sweeping one axis: ``gpus=8..1024`` (doubling), ``inter_gbps=25,100,400``,
``compression=none,fp16``; the plan's axes carry the optimizer's names.

>>> parse_sweep("gpus=8..64")
('gpus', [8, 16, 32, 64])
>>> parse_sweep("compression=none,qsgd4")
('compression', ['none', 'qsgd4'])
>>> parse_sweep("double_buffering=false,true,compensated")
('double_buffering', [False, True, 'compensated'])
"""

from __future__ import annotations

from commopt.sim.configuration import RENAMED, Configuration
from commopt.sim.machines import Machine, get_machine
from commopt.sim.model_profiles import ModelProfile, load_profile
from commopt.sim.step import Prediction, simulate

NUMERIC = {
    "gpus": int,
    "inter_gbps": float,
    "intra_GBps": float,
    "bucket_cap_mb": float,
    "batch": float,
}
CATEGORICAL = ("compression", "overlap", "double_buffering", "algorithm")
_BOOLEANS = {"true": True, "false": False}
AXES = tuple(NUMERIC) + CATEGORICAL


def parse_sweep(spec: str) -> tuple[str, list]:
    """``AXIS=A..B`` (powers of two times A up to B) or ``AXIS=V1,V2,...``."""
    if "=" not in spec:
        raise ValueError(f"--sweep wants AXIS=VALUES (e.g. gpus=8..1024), got {spec!r}")
    axis, values = (s.strip() for s in spec.split("=", 1))
    if axis in RENAMED:
        raise ValueError(f"--sweep: axis {axis!r} is now called {RENAMED[axis]!r}")
    if axis not in AXES:
        raise ValueError(f"cannot sweep {axis!r}; axes: {', '.join(AXES)}")
    out: list
    if axis in CATEGORICAL:
        out = [v.strip() for v in values.split(",") if v.strip()]
        if axis in ("overlap", "double_buffering"):
            out = [_BOOLEANS.get(v.lower(), v) for v in out]
    else:
        kind = NUMERIC[axis]
        try:
            if ".." in values:
                lo, hi = (kind(v) for v in values.split(".."))
                if not 0 < lo <= hi:
                    raise ValueError
                out, v = [], lo
                while v <= hi:
                    out.append(v)
                    v = kind(v * 2)
            else:
                out = [kind(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(
                f"--sweep {axis}: expected A..B with 0 < A <= B or a comma list of "
                f"numbers, got {values!r}"
            ) from None
    if not out:
        raise ValueError(f"--sweep {axis}: no values in {values!r}")
    return axis, out


def run_sweep(
    model: str | ModelProfile,
    machine: str | Machine,
    plan: Configuration,
    gpus: int | None,
    axis: str,
    values: list,
) -> list[tuple[object, Prediction]]:
    """One prediction per value of ``axis``, everything else as given."""
    profile = load_profile(model)
    machine = get_machine(machine)
    rows = []
    for v in values:
        m, p, pl, n = machine, profile, plan, gpus
        if axis == "gpus":
            n = v
        elif axis in _MACHINE_AXES:
            m = machine.with_overrides(**{axis: v})
        elif axis == "batch":
            p = profile.with_overrides(batch_per_gpu=v)
        elif axis in _PLAN_AXES:
            pl = plan.with_(**{axis: v})
        rows.append((v, simulate(p, m, pl, n)))
    return rows


# The axes that are a field of the machine or of the plan, by the field's own name.
_MACHINE_AXES = frozenset({"inter_gbps", "intra_GBps"})
_PLAN_AXES = frozenset({"bucket_cap_mb", "compression", "overlap", "double_buffering", "algorithm"})
