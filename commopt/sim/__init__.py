"""Scaling simulator: step time, throughput and parallel efficiency from 1 to 4096 workers.

Inputs are a model profile (per-layer gradient sizes and backward timings), a machine (links
per level, GPUs per node) and a communication plan in the optimizer's names (algorithm,
compression, bucket_cap_mb, overlap, double_buffering).

    >>> from commopt.sim import simulate, Configuration
    >>> p = simulate("transformer-xl-base", "v100-nvlink-25g", Configuration(), gpus=8)
    >>> round(p.throughput, -3)  # published: 259k tokens/s
    255000.0

See docs/scaling.md for the model, its validation and its limits.
"""

from commopt.sim.codec_costs import (
    CodecCost,
    from_benchmark,
    get_codec_cost,
    list_codec_costs,
)
from commopt.sim.comm_model import allreduce_time
from commopt.sim.configuration import Configuration
from commopt.sim.costs import Link
from commopt.sim.machines import Machine, get_machine, list_machines
from commopt.sim.model_profiles import Layer, ModelProfile, list_profiles, load_profile
from commopt.sim.software import list_software, software_plan
from commopt.sim.step import Prediction, simulate
from commopt.sim.sweep import parse_sweep, run_sweep
from commopt.sim.transport import TRANSPORTS, Transport, parse_nccl_env

__all__ = [
    "TRANSPORTS",
    "CodecCost",
    "Configuration",
    "Layer",
    "Link",
    "Machine",
    "ModelProfile",
    "Prediction",
    "Transport",
    "allreduce_time",
    "from_benchmark",
    "get_codec_cost",
    "get_machine",
    "list_codec_costs",
    "list_machines",
    "list_profiles",
    "list_software",
    "load_profile",
    "parse_nccl_env",
    "parse_sweep",
    "run_sweep",
    "simulate",
    "software_plan",
]
