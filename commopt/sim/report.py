"""Tables and JSON for predictions.

>>> from commopt.sim import simulate, Configuration
>>> rows = [(n, simulate("resnet50", "v100-nvlink-25g", Configuration(), n)) for n in (1, 8)]
>>> format_table(rows, axis="gpus").splitlines()[0].split()[:3]
['gpus', 'nodes', 'algorithm']
"""

from __future__ import annotations

from commopt.sim.step import Prediction
from commopt.tables import table

_COLUMNS = (
    "nodes",
    "algorithm",
    "step ms",
    "compute ms",
    "comm ms",
    "exposed ms",
    "throughput/s",
    "speedup",
    "efficiency",
)


def _number(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _cells(p: Prediction) -> list[str]:
    return [
        str(p.nodes),
        p.algorithm,
        f"{p.step_s * 1e3:.1f}",
        f"{p.compute_s * 1e3:.1f}",
        f"{p.comm_s * 1e3:.1f}",
        f"{p.exposed_comm_s * 1e3:.1f}",
        _number(p.throughput),
        f"{p.speedup:.1f}",
        f"{p.efficiency:.1%}",
    ]


def format_table(rows: list[tuple[object, Prediction]], axis: str = "gpus") -> str:
    """Aligned text table, one row per (axis value, prediction)."""
    header = [axis if axis != "gpus" else "gpus"] + list(_COLUMNS)
    if axis != "gpus":
        header.insert(1, "gpus")
    body = []
    for value, p in rows:
        cells = _cells(p)
        body.append([str(value)] + ([str(p.gpus)] if axis != "gpus" else []) + cells)
    unit = rows[0][1].unit if rows else ""
    text = table(header, body, align="r" * len(header))
    return text + (f"\n(throughput in {unit}/s)" if unit else "")


def to_json(rows: list[tuple[object, Prediction]], *, axis: str, machine, model, plan) -> dict:
    return {
        "machine": machine.to_dict(),
        "model": {
            "name": model.name,
            "sample_unit": model.sample_unit,
            "batch_per_gpu": model.batch_per_gpu,
            "params": model.numel,
            "grad_bytes": model.grad_bytes,
        },
        "plan": {
            "algorithm": plan.algorithm,
            **plan.config(),
            "piece_mb": plan.piece_mb,
            "copy_passes": plan.copy_passes,
        },
        "axis": axis,
        "rows": [{axis: value, **p.as_dict()} for value, p in rows],
    }
