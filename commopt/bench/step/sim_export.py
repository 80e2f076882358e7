"""Simulator measurements from a step-benchmark report (``--sim-measurements``).

The entries are read by ``benchmarks/sim_validation.py --measured``, which checks the
simulator's predicted step times against the measured ones.
"""

from __future__ import annotations

from commopt.bench.step.configs import CONFIGS, POWERSGD_BUCKET_MB

#: Why the simulator cannot predict a configuration (its rows are written, flagged, not counted).
SIM_NOT_MODELLED = {
    "powersgd": (
        "PowerSGD (low-rank factorisation, with its own CPU work per step): the simulator has no "
        "low-rank codec"
    ),
}


def sim_measurements(report: dict) -> list[dict]:
    """Entries for ``benchmarks/sim_validation.py --measured``: one per (model, configuration)
    that ran (fields of ``commopt.sim.validation.Measurement``).

    Compute is the twin's median step (no communication, same moment and cores), gradient
    bytes the fp32 gradient, the measured step the median over rounds of each round's median.
    The plan is what ran, in the optimizer's names: DDP sums with gloo's ring in 25 MiB buckets (torch counts
    ``bucket_cap_mb`` in MiB), fp16 through ``fp16_compress_hook``; commopt's fp32/fp16 buckets
    (25 MiB) go through its transport's ring, qsgd4 through its pipelined scatter-reduce/
    allgather (``scatter_reduce``); ``overlap`` is True (buckets sent during backward) and
    ``double_buffering`` True for ``-db``. PowerSGD rows carry ``not_modelled`` (the reason).

        >>> r = {
        ...     "command": "c",
        ...     "nprocs": 2,
        ...     "rate_bits": 1e9,
        ...     "commopt_comm": "torch",
        ...     "models": {
        ...         "m": {
        ...             "params": 10,
        ...             "rows": [
        ...                 {
        ...                     "config": "commopt-qsgd4-db",
        ...                     "error": None,
        ...                     "step_s": 0.2,
        ...                     "step_rounds": [0.2, 0.3],
        ...                     "compute_s": 0.1,
        ...                 }
        ...             ],
        ...         }
        ...     },
        ... }
        >>> e = sim_measurements(r)[0]
        >>> (
        ...     e["plan"]["algorithm"],
        ...     e["plan"]["compression"],
        ...     e["plan"]["double_buffering"],
        ...     e["grad_bytes"],
        ...     e["transport"],
        ... )
        ('scatter_reduce', 'qsgd4', True, 40, 'torch')
    """
    from commopt.collectives import PIECE_BYTES

    if not report.get("rate_bits"):
        raise ValueError(
            "--sim-measurements needs a run on the emulated link (this report ran on "
            "unshaped loopback): rerun with --link RATE"
        )
    loads = [
        v
        for v in (report.get("load_average_start"), report.get("load_average_end"))
        if v is not None
    ]
    out = []
    for model, info in report["models"].items():
        for row in info["rows"]:
            if row.get("error") or row.get("step_s") is None or row.get("compute_s") is None:
                continue
            cfg = CONFIGS[row["config"]]
            rounds = row.get("step_rounds") or [row["step_s"]]
            plan = {
                "algorithm": "scatter_reduce" if cfg.wire.startswith("qsgd") else "ring",
                "compression": "none" if cfg.wire == "fp32" else cfg.wire,
                "overlap": True,
                "double_buffering": bool(cfg.double_buffering),
                "bucket_cap_mb": 25.0,
            }
            if cfg.wire.startswith("qsgd"):
                plan["piece_mb"] = PIECE_BYTES / 2**20  # the pipeline's pieces, as they ran
            if cfg.wire == "powersgd":
                plan["compression"] = f"powersgd{cfg.powersgd_rank}"
                if cfg.kind == "ddp":
                    plan["bucket_cap_mb"] = float(POWERSGD_BUCKET_MB)
            transport = "torch" if cfg.kind == "ddp" else report.get("commopt_comm", "torch")
            entry = {
                "what": f"step {model} {row['config']}, {report['nprocs']} hosts x 1 rank, "
                f"{report['rate_bits'] / 1e9:g} Gbit/s (median of {len(rounds)} rounds)",
                "command": report["command"],
                "gpus": report["nprocs"],
                "compute_s": row["compute_s"],
                "grad_bytes": 4 * info["params"],
                "measured_step_s": row["step_s"],
                "plan": plan,
                "transport": transport,
                "link_bits_per_s": report["rate_bits"],
                "rounds": len(rounds),
                "measured_min_s": min(rounds),
                "measured_max_s": max(rounds),
            }
            if loads:
                entry["load_average"] = [min(loads), max(loads)]
            if row.get("cpu_s") is not None:
                entry["measured_cpu_s"] = row["cpu_s"]
            if cfg.wire in SIM_NOT_MODELLED:
                entry["not_modelled"] = SIM_NOT_MODELLED[cfg.wire]
            elif cfg.wire == "auto" or cfg.mixed:
                entry["not_modelled"] = (
                    "a per-layer plan (several codecs or schedules in one step): the simulator "
                    "models one codec and one schedule per step"
                )
            out.append(entry)
    return out
