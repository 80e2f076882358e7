"""One training step: compute, buckets of gradients, their all-reduces, and the overlap.

Schedules (:attr:`Configuration.schedule`, from the optimizer's ``overlap`` and ``double_buffering``):
- ``none`` (``overlap=False``): backward, then every bucket's all-reduce, then the update.
- ``backward`` (``overlap=True``, the default; DDP-style buckets): a bucket's all-reduce starts once the backward pass has
  produced all its gradients and the previous bucket's all-reduce is done; the step ends
  when the last one finishes.
- ``double-buffering`` (``double_buffering=True``; ChainerMN): the all-reduce of step t runs during the forward and
  backward of step t+1 and the update uses the previous step's gradients, so the steady-state
  step is the longer of compute and communication.

In every mode the step is at least max(compute, communication).

On a machine whose codec work shares the compute core (``Machine.codec_shares_compute_core``:
a CPU worker with one core, as the testbed's emulated hosts) the transfers still overlap
compute, but the codec work (encode, decode, casts) takes the core from it: with ``backward``
the backward pass ends later by the codec seconds of every bucket whose all-reduce starts
before it ends; with ``double-buffering`` the step is the longer of compute + all codec work
(the core) and the communication (the link, with the codec work the pipeline cannot hide).

    >>> from commopt.sim import simulate, Configuration
    >>> p = simulate(
    ...     "resnet50", "v100-nvlink-25g", Configuration(compression="fp16", double_buffering=True), gpus=32
    ... )
    >>> p.nodes, p.efficiency > 0.9
    (4, True)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from commopt.sim.codec_costs import MEMORY_EFFICIENCY
from commopt.sim.comm_model import allreduce_time
from commopt.sim.configuration import Configuration
from commopt.sim.machines import Machine, get_machine
from commopt.sim.model_profiles import ModelProfile, load_profile


@dataclass(frozen=True)
class Bucket:
    numel: int
    ready_s: float  # since the start of the step
    comm_s: float
    wire_bytes: float
    codec_s: float = 0.0  # the bucket's encode + decode work (processor seconds)
    latency_s: float = 0.0  # its size-independent part (latencies, per-message overheads)


@dataclass(frozen=True)
class Prediction:
    gpus: int
    nodes: int
    algorithm: str
    step_s: float
    compute_s: float
    comm_s: float  # all buckets' all-reduce time, codec included
    exposed_comm_s: float  # step - compute
    throughput: float  # samples/s over all GPUs
    single_gpu_throughput: float
    efficiency: float  # throughput / (gpus * single-GPU throughput)
    unit: str
    wire_bytes_per_step: float
    buckets: int
    codec_s: float = 0.0  # all buckets' encode + decode work (processor seconds)
    copy_s: float = 0.0  # the software's gradient copies on the compute stream
    latency_s: float = 0.0  # the fixed (size-independent) part of all buckets' all-reduces

    @property
    def dominant(self) -> str:
        """What the step time is mostly made of: ``compute`` when the exposed communication
        (step - compute) is shorter than compute, otherwise the largest part of the exposed
        time, split like all communication: ``exposed communication`` (bytes on the links),
        ``latency`` (the size-independent part) or ``codec``."""
        exposed = max(self.step_s - self.compute_s, 0.0)
        if exposed < self.compute_s or self.comm_s <= 0:
            return "compute"
        share = exposed / self.comm_s
        parts = {"codec": self.codec_s * share, "latency": self.latency_s * share}
        parts["exposed communication"] = exposed - parts["codec"] - parts["latency"]
        return max(parts.items(), key=lambda kv: kv[1])[0]

    @property
    def speedup(self) -> float:
        return self.throughput / self.single_gpu_throughput

    def as_dict(self) -> dict:
        d = asdict(self)
        d["speedup"] = self.speedup
        return d


def make_buckets(profile: ModelProfile, bucket_bytes: float, forward_s: float, backward_s: float):
    """Buckets in backward order: (numel, ready time). A layer's gradients are ready when the
    backward pass has gone through it; a bucket closes once it holds ``bucket_bytes``."""
    total_w = sum(lay.backward_weight for lay in profile.layers)
    t = forward_s
    out, numel = [], 0
    for lay in reversed(profile.layers):
        t += backward_s * lay.backward_weight / total_w
        numel += lay.numel
        if numel and numel * profile.grad_bytes_per_param >= bucket_bytes:
            out.append((numel, t))
            numel = 0
    if numel:
        out.append((numel, forward_s + backward_s))
    return out


def simulate(
    model: str | ModelProfile,
    machine: str | Machine,
    plan: Configuration | None = None,
    gpus: int | None = None,
) -> Prediction:
    """Predict one step of data-parallel training of ``model`` on ``gpus`` GPUs of ``machine``."""
    profile = load_profile(model)
    machine = get_machine(machine)
    plan = plan or Configuration()
    gpus = machine.gpus_per_node if gpus is None else gpus
    nodes, _ = machine.layout(gpus)

    step1 = profile.step_time(machine.gpu)
    grad_total = profile.numel * profile.grad_bytes_per_param
    # Gradient-sized copies the software makes on the compute stream (packing, a second
    # buffer): one read and one write each, at the codecs' share of memory bandwidth.
    copy = (
        0.0
        if gpus == 1
        else plan.copy_passes * 2 * grad_total / (machine.memory_GBps * 1e9 * MEMORY_EFFICIENCY)
    )
    forward = step1 * profile.forward_fraction
    update = step1 * profile.update_fraction
    backward = step1 - forward - update + copy
    compute = step1 + copy

    buckets, used = [], []
    for numel, ready in make_buckets(profile, plan.bucket_cap_mb * 2**20, forward, backward):
        algorithm, c = min(
            (
                (
                    a,
                    allreduce_time(
                        machine,
                        gpus,
                        numel=numel,
                        grad_bytes=profile.grad_bytes_per_param,
                        algorithm=a,
                        codec=plan.compression,
                        piece_bytes=plan.piece_mb * 2**20,
                    ),
                )
                for a in plan.candidates()
            ),
            key=lambda ac: ac[1].total_s,
        )
        used.append(algorithm)
        fixed = allreduce_time(
            machine,
            gpus,
            numel=1,
            grad_bytes=profile.grad_bytes_per_param,
            algorithm=algorithm,
            codec=plan.compression,
            piece_bytes=plan.piece_mb * 2**20,
        ).transfer_s
        buckets.append(Bucket(numel, ready, c.total_s, c.wire_bytes, c.codec_s, fixed))
    algorithm = "+".join(sorted(set(used), key=used.index))
    comm = sum(b.comm_s for b in buckets)

    if gpus == 1:
        step = compute
    elif plan.schedule == "none":
        step = compute + comm
    elif plan.schedule == "backward":
        shared = machine.codec_shares_compute_core
        t, delay = 0.0, 0.0  # delay: codec work that ran on the core during backward
        for b in buckets:
            start = max(t, b.ready_s + delay)
            t = start + b.comm_s
            if shared and start < forward + backward + delay:
                delay += b.codec_s
        step = max(forward + backward + delay, t) + update
    elif machine.codec_shares_compute_core:  # double-buffering, codec on the compute core
        step = max(compute + sum(b.codec_s for b in buckets), comm)
    else:  # double-buffering
        step = max(compute, comm)

    single = profile.batch_per_gpu / step1
    throughput = gpus * profile.batch_per_gpu / step
    return Prediction(
        gpus=gpus,
        nodes=nodes,
        algorithm=algorithm if gpus > 1 else "-",
        step_s=step,
        compute_s=compute,
        comm_s=comm if gpus > 1 else 0.0,
        exposed_comm_s=step - compute,
        throughput=throughput,
        single_gpu_throughput=single,
        efficiency=throughput / (gpus * single),
        unit=profile.sample_unit,
        wire_bytes_per_step=sum(b.wire_bytes for b in buckets),
        buckets=len(buckets),
        codec_s=sum(b.codec_s for b in buckets) if gpus > 1 else 0.0,
        copy_s=copy,
        latency_s=sum(b.latency_s for b in buckets) if gpus > 1 else 0.0,
    )
