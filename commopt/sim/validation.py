"""The simulator against published numbers and against this project's testbed.

Published rows (each with its source, listed in docs/scaling.md) are predicted with the
presets as they are: no parameter is fitted to these rows. A row that the model cannot match
within 15% with defensible parameters carries ``known_miss``: the reason, stated rather than
tuned away.

    >>> rows = published_comparison()
    >>> all(abs(r.error) <= 0.15 for r in rows if r.known_miss is None)
    True
    >>> round(physical_allreduce_s(64 * 2**20, 2, 1.0), 4)  # 64 MiB on 1 Gbit/s, 2 hosts
    0.5369
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from commopt.sim.codec_costs import get_codec_cost
from commopt.sim.comm_model import allreduce_time
from commopt.sim.configuration import DEFAULT_PIECE_MB, Configuration
from commopt.sim.costs import GBIT
from commopt.sim.machines import Machine, get_machine
from commopt.sim.model_profiles import Layer, ModelProfile, load_profile
from commopt.sim.model_specs import V100_FP32_RESNET50
from commopt.sim.software import software_plan
from commopt.sim.step import Prediction, simulate

TOLERANCE = 0.15
#: PyTorch DDP + NCCL: 25 MB buckets overlapped with the backward pass, copies into buckets.
DDP = software_plan("pytorch-ddp")

_TXL_3090_4 = (
    "the published 4-GPU Transformer-XL row on the 3090 server needs about 1.5x the staged bandwidth "
    "that its own 2- and 8-GPU rows and all BERT rows on that server fit with (the BERT 4-GPU row is "
    "matched within 9%). The documented alternatives to the measured 6.1 GB/s per switch uplink break "
    "the BERT rows: 8.6 GB/s (the same measurement's cross-switch figure, read as what the 4 GPUs of "
    "one root complex share) puts BERT at +20% to +49%, PCIe 3.0 x16 (12.6 GB/s) at +69% to +97%; "
    "only an undocumented ~7 GB/s with a per-GPU cap of 3.05 GB/s fits every row, which would be "
    "fitting this row, so we keep the measured figure. The workload does not help either: NVIDIA's "
    "train.py (whose DGX-1 rows match the V100 row) wraps the model in DDP with "
    "find_unused_parameters=True, so DDP never rebuilds its buckets and reduces them strictly in "
    "sequence, in reverse definition order; the first holds r_w_bias and r_r_bias, defined last and "
    "used by all 16 layers, so no all-reduce starts before the backward pass reaches layer 0. Modelled "
    "so (overlap none) the 3090 rows fall further: -11 / -33 / -22% for 2 / 4 / 8 GPUs. Nor the placement "
    "(unpublished): 2 + 2 across the switches swings this row to +15% and the BERT 4-GPU row to +72%"
)


_BERT_3090_BATCH = (
    "matched only under the assumed per-GPU batch (4 x 384 tokens; none is published): with 2 or 8 "
    "sequences the 2/4/8-GPU predictions move by -38/-53/-55% or +93/+72/+65%, so these rows are "
    "consistent with the model, not a test of it (the V100 BERT rows move by less than 4%)"
)


@dataclass(frozen=True)
class PublishedRow:
    model: str
    machine: str
    gpus: int
    published: float
    unit: str
    plan: Configuration = DDP
    known_miss: str | None = None  # outside 15% with defensible parameters: why
    caveat: str | None = None  # within 15%, but only under an unpublished assumption
    source: str = "CGX scaling table (PyTorch + NCCL, no compression)"
    batch_per_gpu: float | None = None  # other workload than the profile's default
    single_gpu: float | None = None


def _rows() -> list[PublishedRow]:
    table: dict[tuple[str, str], list[float]] = {
        ("transformer-xl-base", "rtx3090-pcie"): [38e3, 48e3, 68e3, 105e3],
        ("transformer-xl-base", "v100-nvlink-25g"): [37e3, 63e3, 131e3, 259e3],
        ("bert-large", "rtx3090-pcie"): [5820, 5052, 4744, 8606],
        ("bert-large", "v100-nvlink-25g"): [3830, 7034, 14407, 27915],
    }
    out = []
    for (model, machine), values in table.items():
        unit = "tokens/s" if model.startswith("transformer") else "samples/s"
        for gpus, value in zip((1, 2, 4, 8), values):
            miss = (
                _TXL_3090_4
                if (model, machine, gpus) == ("transformer-xl-base", "rtx3090-pcie", 4)
                else None
            )
            caveat = (
                _BERT_3090_BATCH
                if (model, machine) == ("bert-large", "rtx3090-pcie") and gpus > 1
                else None
            )
            out.append(
                PublishedRow(model, machine, gpus, value, unit, known_miss=miss, caveat=caveat)
            )
    # The same Transformer-XL base at half the batch (16 x 192 tokens per GPU) on a DGX-1 with 8x
    # V100 16 GB: NVIDIA DeepLearningExamples' Transformer-XL README, mixed precision.
    for gpus, value in zip((1, 2, 4, 8), (26639, 45299, 92618, 170532)):
        out.append(
            PublishedRow(
                "transformer-xl-base",
                "v100-nvlink-25g",
                gpus,
                value,
                "tokens/s",
                source="NVIDIA DeepLearningExamples Transformer-XL README (DGX-1, batch 16)",
                batch_per_gpu=16 * 192,
                single_gpu=26639,
            )
        )
    return out


PUBLISHED_ROWS = _rows()


@dataclass(frozen=True)
class ComparedRow:
    row: PublishedRow
    prediction: Prediction

    @property
    def predicted(self) -> float:
        return self.prediction.throughput

    @property
    def error(self) -> float:
        return self.predicted / self.row.published - 1

    @property
    def known_miss(self) -> str | None:
        return self.row.known_miss

    @property
    def caveat(self) -> str | None:
        return self.row.caveat


def _predict(r: PublishedRow) -> Prediction:
    profile = load_profile(r.model)
    if r.batch_per_gpu is not None or r.single_gpu is not None:
        profile = profile.with_overrides(
            batch_per_gpu=r.batch_per_gpu, gpu=get_machine(r.machine).gpu, throughput=r.single_gpu
        )
    return simulate(profile, r.machine, r.plan, r.gpus)


def published_comparison() -> list[ComparedRow]:
    """Every published scaling row with its prediction (1-GPU rows are the anchors)."""
    return [ComparedRow(r, _predict(r)) for r in PUBLISHED_ROWS]


@dataclass(frozen=True)
class Effect:
    name: str
    published: str  # the published statement, as a number where there is one
    published_value: float
    predicted_value: float
    baseline_value: float  # the same prediction without the feature
    detail: str = ""

    @property
    def error(self) -> float:
        return self.predicted_value / self.published_value - 1


#: ChainerMN's 2018 experiments trained in FP32 (FP16 was offered for the all-reduce only).
CHAINERMN_FP32 = (
    "FP32 compute: ResNet-50 on one V100 at 367 img/s (NVIDIA DeepLearningExamples ResNet-50 "
    "v1.5 README, FP32); P100: the profile's FP32 figure"
)


def chainermn_profile(machine: str) -> ModelProfile:
    """ResNet-50 as ChainerMN's 2018 runs computed it: FP32, batch 64 per GPU."""
    gpu = get_machine(machine).gpu
    profile = load_profile("resnet50")
    if gpu == "v100":
        profile = profile.with_overrides(gpu="v100", throughput=V100_FP32_RESNET50)
    return profile


def chainermn_efficiency(
    machine: str | Machine, plan: Configuration, small: int = 8, large: int = 32
) -> float:
    """Parallel efficiency from ``small`` to ``large`` GPUs, e = t / (t0 n) (published definition)."""
    m = get_machine(machine)
    profile = chainermn_profile(m.name.split("[")[0].split("@")[0].split("+")[0])
    base = simulate(profile, m, plan, small)
    many = simulate(profile, m, plan, large)
    return many.throughput / (large / small * base.throughput)


#: AWS p3.16xlarge as ChainerMN 1.3 ran on it in 2018: NCCL 2.1/2.2 sockets, one socket per
#: connection, 10 Gbit/s per flow on EC2.
CHAINERMN_AWS = "v100-nvlink-25g"
CHAINERMN_AWS_TRANSPORT = "nccl-2.2-sockets-ec2"


def chainermn_effect() -> Effect:
    """ResNet-50 8 -> 32 GPUs on AWS (p3.16xlarge, 25 Gbit/s), double buffering + FP16: 96%."""
    m = get_machine(CHAINERMN_AWS).with_overrides(transport=CHAINERMN_AWS_TRANSPORT)
    return chainermn_db_fp16_effect(
        m, "V100 over 25 Gbit/s", "96% parallel efficiency (8 -> 32 GPUs)", 0.96
    )


def chainermn_db_fp16_effect(
    machine: str | Machine, gpus: str, published: str, published_value: float
) -> Effect:
    """ChainerMN 1.3's double buffering + FP16 all-reduce against its plain pure_nccl, 8 -> 32
    ``gpus`` on ``machine``."""
    with_features = chainermn_efficiency(
        machine, software_plan("chainermn-1.3-pure_nccl-db", compression="fp16")
    )
    without = chainermn_efficiency(machine, software_plan("chainermn-1.3-pure_nccl"))
    return Effect(
        f"ChainerMN 1.3: double buffering + FP16 all-reduce, ResNet-50, 8 -> 32 {gpus} "
        "(NCCL 2.2 sockets)",
        published,
        published_value,
        with_features,
        without,
        "baseline: ChainerMN 1.3 pure_nccl, FP32 all-reduce after the backward pass",
    )


#: What CGX's published scaling runs used: "4 bits quantization with 1024 bucket size" for all
#: experiments (pytorch-cgx.github.io/benchmarks), not the 128 of its accuracy-safe default.
CGX_BENCHMARK_CODEC = "qsgd4b1024"


def cgx_effect(model: str = "transformer-xl-base") -> Effect:
    """4-bit QSGD (CGX's benchmark setting) on the 3090 server vs the V100 server's published
    8-GPU scaling."""
    v100 = {"transformer-xl-base": (259e3, 37e3), "bert-large": (27915, 3830)}[model]
    v100_eff = v100[0] / (8 * v100[1])
    compressed = simulate(
        model, "rtx3090-pcie", Configuration(compression=CGX_BENCHMARK_CODEC), 8
    ).efficiency
    plain = simulate(model, "rtx3090-pcie", DDP, 8).efficiency
    return Effect(
        f"CGX: 4-bit QSGD (bucket 1024, as CGX's runs) on 8x RTX 3090, {model}",
        f"about the V100 server's scaling ({v100_eff:.1%} at 8 GPUs)",
        v100_eff,
        compressed,
        plain,
        "baseline: the same server without compression",
    )


# --- this project's testbed ---------------------------------------------------------------

#: The machine preset of each transport of the testbed (``transport`` of a measurement).
TRANSPORT_MACHINES = {
    "mpi": "testbed-1gbit",
    "torch": "testbed-1gbit-gloo",
    "gloo": "testbed-1gbit-gloo",
}

#: Transports the simulator does not model, and why (their rows are shown, not counted).
NOT_MODELLED = {
    "mpi-native": (
        "Open MPI's own collectives (COMMOPT_MPI_PIPELINE=off, Open MPI's TCP eager limit): the "
        "transport before commopt's pipelined path, at about 1.8-2x the link time; the simulator "
        "predicts what the link allows"
    ),
}


def physical_allreduce_s(nbytes: float, hosts: int, gbps: float) -> float:
    """The bandwidth floor of an all-reduce: 2(n-1)/n * bytes / line rate."""
    return 2 * (hosts - 1) / hosts * nbytes / (gbps * GBIT)


def predict_testbed_allreduce(
    nbytes: float = 64 * 2**20, hosts: int = 2, codec: str = "none", machine: str = "testbed-1gbit"
) -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` float32 bytes on the testbed: the
    transport's ring for linear codecs, commopt's pipelined scatter-reduce/allgather otherwise."""
    c = get_codec_cost(codec)
    return allreduce_time(
        get_machine(machine),
        hosts,
        numel=nbytes / 4,
        grad_bytes=4,
        algorithm="ring" if c.linear else "scatter_reduce",
        codec=c,
    ).total_s


def synthetic_profile(
    compute_s: float,
    grad_bytes: float,
    *,
    batch: float = 1.0,
    layers: int = 16,
    forward_fraction: float = 1 / 3,
    device: str = "cpu",
    name: str = "measured",
) -> ModelProfile:
    """A profile from two measured numbers: compute time per step and gradient bytes (float32),
    spread evenly over ``layers`` layers."""
    if not compute_s > 0 or not grad_bytes > 0:
        raise ValueError(
            f"compute time and gradient bytes must be > 0, got {compute_s} s and {grad_bytes} B"
        )
    numel = round(grad_bytes / 4)
    per, extra = divmod(numel, layers)
    return ModelProfile(
        name=name,
        sample_unit="samples",
        batch_per_gpu=batch,
        grad_bytes_per_param=4,
        forward_fraction=forward_fraction,
        throughput={device: batch / compute_s},
        layers=tuple(Layer(f"layer{i}", per + (1 if i < extra else 0), 1.0) for i in range(layers)),
        description=f"synthetic: {compute_s} s compute, {grad_bytes:.0f} gradient bytes",
    )


def compare_measured(
    *,
    measured_step_s: float,
    compute_s: float,
    grad_bytes: float,
    gpus: int = 2,
    plan: Configuration | None = None,
    machine: str | Machine = "testbed-1gbit",
) -> dict:
    """Predicted vs measured step time for a testbed run."""
    plan = plan or Configuration("ring", "none", 25, overlap=False)
    machine = get_machine(machine)
    pred = simulate(
        synthetic_profile(compute_s, grad_bytes, device=machine.gpu), machine, plan, gpus
    )
    return {
        "gpus": gpus,
        "plan": plan.describe(),
        "predicted_step_s": pred.step_s,
        "measured_step_s": measured_step_s,
        "error": pred.step_s / measured_step_s - 1,
        "comm_s": pred.comm_s,
        "codec_s": pred.codec_s,
    }


@dataclass
class Measurement:
    """One testbed measurement, as ``benchmarks/allreduce_link.py --sim-measurements`` (an
    allreduce alone) and ``commopt bench step --sim-measurements`` (training steps) write it:
    what ran, the exact command, workers (hosts), compute seconds per step (1 us for an
    allreduce alone), gradient bytes (float32), the measured step seconds (the median over
    rounds), and the plan that ran. Optional: the transport (``mpi``, ``torch``, ``mpi-native``;
    otherwise read from the command), a machine preset or file that overrides it, the link's
    line rate, the fastest and slowest round, each round's time with the machine's load, and
    ``not_modelled``: the reason, for a configuration the simulator cannot predict (its row is
    shown, not counted), and ``measured_cpu_s``: the processor time one rank used per step (all
    its threads), shown beside a miss. The plan is a ``create_multi_node_optimizer``
    configuration (:meth:`Configuration.from_config`) with the simulator's ``piece_mb`` where it
    differs; a codec ``<codec>+ef`` (error feedback) is predicted as ``<codec>``: the
    residual's passes over the gradient are not modelled."""

    what: str
    command: str
    gpus: int
    compute_s: float
    grad_bytes: float
    measured_step_s: float
    plan: dict = field(
        default_factory=lambda: {"algorithm": "ring", "compression": "none", "overlap": False}
    )
    transport: str | None = None
    machine: str | None = None
    link_bits_per_s: float | None = None
    rounds: int | None = None
    measured_min_s: float | None = None
    measured_max_s: float | None = None
    load_average: list | None = None
    per_round: list | None = None
    not_modelled: str | None = (
        None  # why the simulator cannot predict this row (shown, not counted)
    )
    measured_cpu_s: float | None = None  # one rank's processor time per step (not an input)

    @property
    def kind(self) -> str:
        """``allreduce`` (an allreduce alone: no compute) or ``step`` (a training step)."""
        return "allreduce" if self.compute_s <= 1e-3 else "step"

    def transport_name(self) -> str:
        if self.transport:
            return self.transport
        if "COMMOPT_MPI_PIPELINE=off" in self.command:
            return "mpi-native"
        return "torch" if "--comm torch" in self.command else "mpi"


_FIELDS = ", ".join(Measurement.__dataclass_fields__)


def load_measurements(path: str) -> list[Measurement]:
    """Testbed measurements from a JSON list of :class:`Measurement` fields."""
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"measurement file {path!r} does not exist (write one with "
            f"benchmarks/allreduce_link.py --sim-measurements)"
        )
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of measurements, got {type(data).__name__}")
    try:
        return [Measurement(**e) for e in data]
    except TypeError as exc:
        raise ValueError(
            f"{path}: each entry needs what, command, gpus, compute_s, grad_bytes, "
            f"measured_step_s and may have: {_FIELDS}: {exc}"
        ) from exc


def testbed_machine(m: Measurement, codec_speeds: tuple = ()) -> Machine:
    """The preset of the measurement's transport (or its own machine), at its link rate, with
    ``codec_speeds`` (``Machine.codec_GBps`` entries) replacing the preset's measured ones."""
    transport = m.transport_name()
    name = m.machine or TRANSPORT_MACHINES.get(transport, "testbed-1gbit")
    machine = get_machine(name)
    if m.link_bits_per_s and abs(m.link_bits_per_s / 1e9 - machine.inter_gbps) > 1e-9:
        machine = machine.with_overrides(inter_gbps=m.link_bits_per_s / 1e9)
    if codec_speeds:
        kept = tuple(e for e in machine.codec_GBps if e[0] not in {c[0] for c in codec_speeds})
        machine = replace(machine, codec_GBps=kept + tuple(codec_speeds))
    return machine


def _plan_codec(m: Measurement) -> str:
    """The simulator's codec of a measurement's plan (error feedback, ``+ef``, not modelled)."""
    return (m.plan.get("compression") or "none").removesuffix("+ef")


def compare_measurement(m: Measurement, machine: Machine) -> dict:
    """:func:`compare_measured` on a measurement's step, with its plan (the job's defaults
    where it names none) on ``machine``."""
    config = {"algorithm": "ring", "overlap": False, **m.plan}
    piece_mb = config.pop("piece_mb", DEFAULT_PIECE_MB)
    plan = Configuration.from_config(config, piece_mb=piece_mb)
    return compare_measured(
        measured_step_s=m.measured_step_s,
        compute_s=m.compute_s,
        grad_bytes=m.grad_bytes,
        gpus=m.gpus,
        plan=plan,
        machine=machine,
    )


def _link_limit_s(m: Measurement, machine: Machine) -> float | None:
    """The gradient's allreduce on the link: 2(n-1)/n x the codec's wire bytes / line rate."""
    try:
        codec = get_codec_cost(_plan_codec(m))
    except ValueError:
        return None
    return physical_allreduce_s(codec.wire_bytes(m.grad_bytes / 4, 4), m.gpus, machine.inter_gbps)


def _round_evidence(m: Measurement, predicted_s: float) -> dict | None:
    """The fastest round and the round at the lowest machine load, each with its error (without
    each round's load: the fastest round alone, from ``measured_min_s``)."""
    rounds = [r for r in (m.per_round or []) if "time_s" in r and "load_average" in r]
    if not rounds:
        if m.measured_min_s is None:
            return None
        fastest = {
            "time_s": m.measured_min_s,
            "load_average": None,
            "error": predicted_s / m.measured_min_s - 1,
        }
        return {"fastest": fastest, "quietest": fastest}

    def one(r):
        return {
            "time_s": r["time_s"],
            "load_average": r["load_average"],
            "error": predicted_s / r["time_s"] - 1,
        }

    return {
        "fastest": one(min(rounds, key=lambda r: r["time_s"])),
        "quietest": one(min(rounds, key=lambda r: r["load_average"])),
    }


def compare_testbed_measurements(
    measurements: list[Measurement], codec_speeds: tuple = ()
) -> list[dict]:
    """Every measurement with its prediction, on its transport's preset.

    ``status`` is ``ok`` (median within 15%), ``miss`` or ``not modelled`` (a transport the
    simulator does not model; ``reason`` says why). For a miss, ``evidence`` gives the fastest
    round and the round taken at the lowest machine load, where the file has rounds: the
    simulator's inputs (codec speeds, link) are those of an idle machine, and the emulated
    hosts share 2 cores with whatever else runs.
    """
    out = []
    for m in measurements:
        machine = testbed_machine(m, codec_speeds)
        row: dict[str, Any]  # values of several types, filled in below
        row = {
            "what": m.what,
            "command": m.command,
            "transport": m.transport_name(),
            "machine": machine.name,
            "kind": m.kind,
            "compute_s": m.compute_s,
            "limit_s": _link_limit_s(m, machine),
            "measured_min_s": m.measured_min_s,
            "measured_max_s": m.measured_max_s,
            "load_average": m.load_average,
            "evidence": None,
            "measured_cpu_s": m.measured_cpu_s,
        }
        if m.not_modelled:
            # A codec the simulator lacks: no prediction at all.
            row.update(
                gpus=m.gpus,
                plan=", ".join(f"{k} {v}" for k, v in m.plan.items()),
                predicted_step_s=None,
                measured_step_s=m.measured_step_s,
                error=None,
                comm_s=None,
                status="not modelled",
                reason=m.not_modelled,
                label=m.plan.get("compression", m.what),
            )
            out.append(row)
            continue
        row.update(compare_measurement(m, machine))
        if row["transport"] in NOT_MODELLED:
            row["status"], row["reason"] = "not modelled", NOT_MODELLED[row["transport"]]
            row["label"] = row["transport"]
        elif abs(row["error"]) <= TOLERANCE:
            row["status"], row["reason"] = "ok", None
        else:
            row["status"], row["reason"] = "miss", None
            row["evidence"] = _round_evidence(m, row["predicted_step_s"])
        out.append(row)
    return out
