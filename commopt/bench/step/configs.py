"""What each configuration of the step benchmark is, and the bytes it puts on the wire.

Every configuration is one column of the comparison: PyTorch DDP in fp32 (gloo), DDP with
``fp16_compress_hook``, DDP with the PowerSGD hook at rank 1 and 4 (one bucket: see
``POWERSGD_BUCKET_MB``), compressing from its second step or (``-warm``) after torch's
documented warm-up of plain allreduce (``start_powerSGD_iter``: see ``powersgd_start_iter``);
commopt with fp32, fp16, qsgd4, qsgd4 + error feedback and its own low-rank codec
(``powersgd1``, ``powersgd4``: rank 1 and 4, error feedback and warm start, the matrices
torch's hook would compress, the rest in fp32), each with overlap (reduction during backward),
with double buffering (``-db``: reduction during the next step) and with compensated double
buffering (``-comp``: the stale averages applied at predicted weights; the model's
``nn.Embedding`` weights reduce synchronously, the wrapper's default rule); qsgd4+EF and
PowerSGD rank 4 also as a mixed plan (``-mixed``: double buffering, the model's first and
last layers synchronous through ``plans=``); and ``compression="auto"`` (``commopt-auto``,
``-db``, ``-comp``); commopt's local-steps schedule (``commopt-local-steps16``: DiLoCo, 16
inner steps between synchronisations, fp32 outer gradients; ``-qsgd4+ef``: 4-bit outer
gradients with error feedback; ``-stream-qsgd4+ef``: Streaming DiLoCo, 2 fragments each
overlapping 1 inner step; ``-stream-overlap3-qsgd4+ef``: 3 inner steps) and torchft's
``DiLoCo`` as a peer (``torchft-diloco16``, where torchft imports). ``wrap_commopt`` and
``wrap_ddp`` build one on a rank.

A local-steps configuration sends nothing on most steps: its time and bytes per step are means
over whole synchronisation cycles of ``sync_every`` steps (:func:`cycle_mean`), never medians.

    >>> CONFIGS["commopt-qsgd4+ef-db"].label
    'commopt qsgd4+EF, double buffering'
    >>> CONFIGS["commopt-qsgd4+ef-comp"].double_buffering
    'compensated'
    >>> powersgd_start_iter(CONFIGS["ddp-powersgd4-warm"], budget=200, warmup=0.1)
    20
    >>> powersgd_start_iter(CONFIGS["ddp-powersgd4"], budget=200, warmup=0.1)
    2
    >>> ddp_wire_bytes(CONFIGS["ddp-fp16"], [(4096, 1024), (4096,)])
    8396800
    >>> allreduce_limit_s(100e6, 2, parse_rate("1gbit"))
    0.8
    >>> CONFIGS["commopt-local-steps16-stream-qsgd4+ef"].cycle
    16
    >>> CONFIGS["commopt-local-steps16-stream-overlap3-qsgd4+ef"].overlap_steps
    3
    >>> cycle_mean([1.0, 0.0, 0.0, 0.0, 5.0], 4)  # one whole cycle; the fifth step is cut
    0.25
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commopt.optim import MultiNodeOptimizer

#: DDP bucket size for the PowerSGD hook: larger than any model here, so one bucket. On gloo
#: PowerSGD over DDP's default 25 MB buckets fails at its first compressed step (the
#: buckets' collectives interleave differently on each rank: a collective size mismatch
#: abort, or here a hang until the gloo timeout).
POWERSGD_BUCKET_MB = 4096
#: PowerSGD runs plain allreduce for its first iterations; 2 is the smallest it accepts with
#: error feedback and warm start. Warm-up steps cover them.
POWERSGD_START_ITER = 2
#: The ``-warm`` configurations' plain-allreduce warm-up, as a fraction of the training
#: budget: torch's PowerSGDState documentation suggests starting ``start_powerSGD_iter`` at
#: 10% of the total training steps (and raising it until the accuracy is satisfactory).
POWERSGD_WARMUP_FRACTION = 0.1
#: ``double_buffering`` of a configuration: False (overlap), "stale" (plain, ChainerMN's; the
#: ``-db`` configurations, as measured) or "compensated" (``-comp``; ``double_buffering=True``).
STALE = "stale"
COMPENSATED = "compensated"


@dataclass(frozen=True)
class StepConfig:
    """One column of the comparison."""

    name: str
    kind: str  # "ddp" or "commopt"
    # "fp32", "fp16", "powersgd" (rank: powersgd_rank), "qsgd4", "qsgd4+ef", "auto"
    wire: str
    label: str
    powersgd_rank: int = 0
    # commopt's schedule: False (overlap), "stale" (plain double buffering) or "compensated"
    double_buffering: bool | str = False
    # DDP PowerSGD: plain allreduce for the budget's first POWERSGD_WARMUP_FRACTION
    powersgd_warmup: bool = False
    # commopt: the model's first and last layers reduce synchronously (plans= rules)
    mixed: bool = False
    # local steps (commopt's schedule, torchft's DiLoCo): inner steps between two
    # synchronisations of a fragment (0: a reduction every step), fragments, overlap steps
    sync_every: int = 0
    fragments: int = 1
    overlap_steps: int = 0

    @property
    def cycle(self) -> int:
        """Steps of one whole cycle of the configuration's traffic (1: every step alike)."""
        return max(1, self.sync_every)

    @property
    def local_steps(self) -> bool:
        return self.sync_every > 0


_MODES = (
    (False, "", "overlap"),
    (STALE, "-db", "double buffering"),
    (COMPENSATED, "-comp", "compensated double buffering"),
)


def _configs() -> dict[str, StepConfig]:
    out = [
        StepConfig("ddp-fp32", "ddp", "fp32", "DDP fp32"),
        StepConfig("ddp-fp16", "ddp", "fp16", "DDP fp16_compress_hook"),
        StepConfig("ddp-bf16", "ddp", "bf16", "DDP bf16_compress_hook"),
        StepConfig("ddp-powersgd1", "ddp", "powersgd", "DDP PowerSGD rank 1", powersgd_rank=1),
        StepConfig("ddp-powersgd4", "ddp", "powersgd", "DDP PowerSGD rank 4", powersgd_rank=4),
    ]
    out += [
        StepConfig(
            f"ddp-powersgd{rank}-warm",
            "ddp",
            "powersgd",
            f"DDP PowerSGD rank {rank}, warm-up",
            powersgd_rank=rank,
            powersgd_warmup=True,
        )
        for rank in (1, 4)
    ]
    for db, suffix, mode in _MODES:
        for wire, label in (
            ("fp32", "fp32"),
            ("fp16", "fp16"),
            ("qsgd4", "qsgd4"),
            ("qsgd4+ef", "qsgd4+EF"),
        ):
            out.append(
                StepConfig(
                    f"commopt-{wire}{suffix}",
                    "commopt",
                    wire,
                    f"commopt {label}, {mode}",
                    double_buffering=db,
                )
            )
        out += [
            StepConfig(
                f"commopt-powersgd{rank}{suffix}",
                "commopt",
                "powersgd",
                f"commopt PowerSGD rank {rank}, {mode}",
                powersgd_rank=rank,
                double_buffering=db,
            )
            for rank in (1, 4)
        ]
    for wire, label, rank in (("qsgd4+ef", "qsgd4+EF", 0), ("powersgd", "PowerSGD rank 4", 4)):
        stem = "powersgd4" if rank else wire
        out.append(
            StepConfig(
                f"commopt-{stem}-mixed",
                "commopt",
                wire,
                f"commopt {label}, double buffering, first/last layer synchronous",
                powersgd_rank=rank,
                double_buffering=STALE,
                mixed=True,
            )
        )
    for db, suffix, mode in _MODES:
        out.append(
            StepConfig(
                f"commopt-auto{suffix}",
                "commopt",
                "auto",
                f"commopt auto, {mode}",
                double_buffering=db,
            )
        )
    out += local_steps_configs()
    return {c.name: c for c in out}


#: The local-steps configurations' H (Streaming: P fragments, each overlapping tau steps).
LOCAL_STEPS_H = 16
LOCAL_STEPS_FRAGMENTS = 2
LOCAL_STEPS_OVERLAP = 1
#: ``-stream-overlap3-`` and ``-auto-stream16-overlap3``: each fragment's reduction overlapping
#: 3 inner steps (for a transfer longer than one step's compute)
LOCAL_STEPS_LONG_OVERLAP = 3
#: ``-stream-overlap7-`` and ``-auto-stream16-overlap7``: the longest overlap that keeps one
#: fragment's reduction on the link at a time (H / P - 1 steps; the next fragment starts the
#: step after it is applied), for a transfer of several steps' compute
LOCAL_STEPS_FULL_OVERLAP = LOCAL_STEPS_H // LOCAL_STEPS_FRAGMENTS - 1


def _overlap_suffix(overlap: int) -> str:
    """A streaming configuration's name part: none at the default overlap, else ``-overlapN``."""
    return "" if overlap == LOCAL_STEPS_OVERLAP else f"-overlap{overlap}"


def local_steps_configs() -> list[StepConfig]:
    """commopt's local-steps schedule (plain fp32, qsgd4+EF outer gradients, streaming; also
    at H = 32), ``compression="auto"`` with streaming local steps at H as a candidate beside
    the per-step plans, and torchft's ``DiLoCo`` (fp32 outer gradients, one fragment)."""
    h, p, tau = LOCAL_STEPS_H, LOCAL_STEPS_FRAGMENTS, LOCAL_STEPS_OVERLAP
    out = [
        StepConfig(
            f"commopt-local-steps{h}",
            "commopt",
            "fp32",
            f"commopt local steps H={h}, fp32 outer gradients",
            sync_every=h,
        )
    ]
    out.extend(
        StepConfig(
            f"commopt-local-steps{every}-qsgd4+ef",
            "commopt",
            "qsgd4+ef",
            f"commopt local steps H={every}, qsgd4+EF outer gradients",
            sync_every=every,
        )
        for every in (h, 2 * h)
    )
    out.extend(
        StepConfig(
            f"commopt-local-steps{h}-stream{_overlap_suffix(overlap)}-qsgd4+ef",
            "commopt",
            "qsgd4+ef",
            f"commopt streaming local steps H={h}, {p} fragments, overlap {overlap}, "
            "qsgd4+EF outer gradients",
            sync_every=h,
            fragments=p,
            overlap_steps=overlap,
        )
        for overlap in (tau, LOCAL_STEPS_LONG_OVERLAP, LOCAL_STEPS_FULL_OVERLAP)
    )
    out.extend(
        StepConfig(
            f"commopt-auto-stream{h}{_overlap_suffix(overlap)}",
            "commopt",
            "auto",
            f"commopt auto, streaming local steps H={h} ({p} fragments, overlap {overlap}) "
            "a candidate",
            sync_every=h,
            fragments=p,
            overlap_steps=overlap,
        )
        for overlap in (tau, LOCAL_STEPS_LONG_OVERLAP, LOCAL_STEPS_FULL_OVERLAP)
    )
    out.append(
        StepConfig(
            f"torchft-diloco{h}",
            "torchft",
            "fp32",
            f"torchft DiLoCo H={h}, fp32 outer gradients",
            sync_every=h,
        )
    )
    return out


def cycle_mean(values, cycle: int) -> float | None:
    """The mean of ``values`` (per-step times or bytes, in step order) over their whole cycles
    of ``cycle`` steps: a configuration that synchronises every ``cycle`` steps is timed over
    its silent steps and its synchronising ones alike. None when not one whole cycle ran.

        >>> cycle_mean([0.1, 0.1, 0.1, 0.9, 0.1, 0.1, 0.1, 0.9], 4)
        0.3
        >>> cycle_mean([0.1, 0.2], 4) is None
        True
    """
    if cycle < 1:
        raise ValueError(f"a cycle is at least 1 step, got {cycle}")
    whole = len(values) // cycle * cycle
    if whole == 0:
        return None
    return round(math.fsum(values[:whole]) / whole, 12)


def step_seconds(cfg: StepConfig | None, times: Sequence[float]) -> float | None:
    """A configuration's time per step from its step times (in step order): the median, or
    for a local-steps configuration the mean over whole cycles (:func:`cycle_mean`; a median
    would see only the silent steps). None when there is no time, or not one whole cycle.
    ``cfg`` None: a configuration this module does not know, priced at the median.

        >>> step_seconds(CONFIGS["ddp-fp32"], [0.1, 0.1, 0.1, 0.9])
        0.1
        >>> step_seconds(CONFIGS["commopt-local-steps16"], [0.1] * 15 + [1.7])
        0.2
        >>> step_seconds(CONFIGS["commopt-local-steps16"], [0.1] * 15) is None
        True
    """
    if cfg is not None and cfg.local_steps:
        return cycle_mean(times, cfg.cycle)
    return statistics.median(times) if times else None


CONFIGS: dict[str, StepConfig] = _configs()
#: What `commopt bench step` runs by default (not DDP's bf16 hook, which torch refuses without
#: CUDA and NCCL or XPU): DDP's four and commopt's fp32, fp16, qsgd4,
#: qsgd4+EF and PowerSGD rank 1 and 4, each with overlap and with double buffering.
STEP_DEFAULT_CONFIGS = tuple(
    name
    for name, c in CONFIGS.items()
    if not (
        c.powersgd_warmup
        or c.mixed
        or c.wire in ("auto", "bf16")  # bf16: torch's hook needs CUDA/NCCL or XPU
        or c.double_buffering == COMPENSATED
        or c.local_steps
    )
)
#: The local-steps configurations of `commopt bench step` (``--configs local-steps``).
LOCAL_STEPS_CONFIGS = tuple(name for name, c in CONFIGS.items() if c.local_steps)
#: What `commopt demo` runs: DDP fp32 against commopt's fp16, qsgd4 and double buffering.
DEMO_CONFIGS = (
    "ddp-fp32",
    "commopt-fp16",
    "commopt-qsgd4",
    "commopt-fp16-db",
    "commopt-qsgd4+ef-db",
)


def parse_rate(text: str) -> float:
    """Bits per second from tc-style text (``1gbit``, ``100mbit``, ``2.5gbit``): the testbed's reader."""
    from commopt.testbed.shaping import parse_rate as read_tc_rate

    return float(read_tc_rate(text))


def allreduce_limit_s(nbytes: float, n: int, rate_bits: float | None) -> float | None:
    """Least time a bandwidth-optimal allreduce of ``nbytes`` needs: 2(n-1)/n x bytes / rate."""
    if rate_bits is None or rate_bits <= 0:
        return None
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes * 8 / rate_bits


def powersgd_wire_bytes(shapes, rank: int, min_compression_rate: float = 2) -> int:
    """Bytes one PowerSGD step allreduces (fp32): P and Q of each compressed matrix, the rest whole.

    Follows torch's hook: a tensor of ndim > 1 is viewed as (shape[0], rest) and compressed
    when (rows + cols) x rank x min_compression_rate < rows x cols.
    """
    elems = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) > 1:
            rows, cols = shape[0], numel // shape[0]
            compressed = (rows + cols) * rank
            if compressed * min_compression_rate < rows * cols:
                elems += compressed
                continue
        elems += numel
    return 4 * elems


def ddp_wire_bytes(config: StepConfig, shapes) -> int:
    """Bytes one DDP step of ``config`` allreduces for parameters of ``shapes``."""
    numel = sum(math.prod(s) for s in shapes)
    if config.wire == "fp32":
        return 4 * numel
    if config.wire in ("fp16", "bf16"):
        return 2 * numel
    if config.wire == "powersgd":
        return powersgd_wire_bytes(shapes, config.powersgd_rank)
    raise ValueError(f"DDP has no wire format {config.wire!r}")


def powersgd_start_iter(
    cfg: StepConfig, budget: int, warmup: float = POWERSGD_WARMUP_FRACTION
) -> int:
    """``start_powerSGD_iter`` of a DDP PowerSGD configuration trained ``budget`` steps.

    ``-warm``: ``warmup`` (a fraction) of the budget, at least 2; else 2, the least torch's
    hook accepts with error feedback and warm start.
    """
    if not cfg.powersgd_warmup:
        return POWERSGD_START_ITER
    if not 0 <= warmup < 1:
        raise ValueError(
            f"the PowerSGD warm-up is a fraction of the budget in [0, 1); got {warmup}"
        )
    return max(POWERSGD_START_ITER, round(warmup * budget))


def wrap_ddp(model, cfg: StepConfig, start_iter: int = POWERSGD_START_ITER):
    """``model`` in DDP with this configuration's communication hook (torch.distributed is up).

    ``start_iter``: PowerSGD's ``start_powerSGD_iter`` (see ``powersgd_start_iter``).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if cfg.wire == "fp32":
        return DDP(model)
    if cfg.wire in ("fp16", "bf16"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = getattr(default_hooks, f"{cfg.wire}_compress_hook")
        ddp = DDP(model)
        ddp.register_comm_hook(None, hook)
        return ddp
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    ddp = DDP(model, bucket_cap_mb=POWERSGD_BUCKET_MB)  # one bucket: see POWERSGD_BUCKET_MB
    state = powersgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=cfg.powersgd_rank,
        start_powerSGD_iter=max(POWERSGD_START_ITER, start_iter),
    )
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return ddp


def mixed_plan_rules(model) -> list[tuple[str, dict]]:
    """``plans=`` rules putting ``model``'s first and last layers (by parameter name) on the
    synchronous schedule: the layers whose parameters come first and last in
    ``model.named_parameters()`` (an embedding is usually the first).

        >>> import torch
        >>> mixed_plan_rules(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)))
        [('0.*', {'double_buffering': False}), ('1.*', {'double_buffering': False})]
    """
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not names:
        raise ValueError("a mixed plan needs a model with trainable parameters")
    layers = []
    for name in (names[0], names[-1]):
        layer = name.rsplit(".", 1)[0] if "." in name else name
        pattern = f"{layer}.*" if "." in name else layer
        if pattern not in layers:
            layers.append(pattern)
    return [(pattern, {"double_buffering": False}) for pattern in layers]


def wrap_commopt(
    inner, comm, model, cfg: StepConfig, outer_lr: float | None = None
) -> MultiNodeOptimizer:
    """``inner`` wrapped by commopt's optimizer with this configuration's wire format
    (``outer_lr``: a local-steps configuration's outer learning rate, else the schedule's)."""
    import commopt

    kwargs: dict[str, Any] = {}
    if cfg.wire == "fp16":
        kwargs["allreduce_grad_dtype"] = "float16"  # every gradient in 16 bits, as DDP's hook
    elif cfg.wire.startswith("qsgd") or cfg.wire == "auto":
        kwargs["compression"] = cfg.wire
    elif cfg.wire == "powersgd":
        kwargs["compression"] = f"powersgd{cfg.powersgd_rank}"
    if cfg.mixed:
        kwargs["plans"] = mixed_plan_rules(model)
    if cfg.local_steps:
        kwargs.update(
            sync_every=cfg.sync_every, fragments=cfg.fragments, overlap_steps=cfg.overlap_steps
        )
        if cfg.wire != "auto":  # auto prices local steps beside the per-step plans
            kwargs["schedule"] = "local_steps"
        if outer_lr is not None:
            kwargs["outer_lr"] = outer_lr
    return commopt.create_multi_node_optimizer(
        inner, comm, double_buffering=cfg.double_buffering, overlap=True, model=model, **kwargs
    )


def reducer_wire_bytes(reducer) -> int:
    """Bytes one reduction of ``reducer``'s buckets puts on the wire, from their codecs (a
    low-rank bucket's wire depends on its tensors' shapes, which the buckets' slots index)."""
    from commopt.codecs import PowerSGD

    total = 0
    params = reducer.params
    for b in reducer.buckets:
        if isinstance(b.codec, PowerSGD):
            shapes = [(s.offset, tuple(params[s.param].shape)) for s in b.slots]
            total += 4 * b.codec.wire_numel(b.numel, shapes)
        elif b.codec is not None:
            total += b.codec.encoded_nbytes(b.numel)
        else:
            total += b.dtype.itemsize * b.numel
    return int(total)


def commopt_sent_bytes(opt, step: int | None = None) -> int:
    """Bytes commopt's optimizer ``opt`` sent during its inner step ``step`` (1-based; None:
    the step each part took last, asked right after it).

    A part that reduces every step sends its buckets each step; a local-steps part sends a
    fragment's outer gradients on the steps whose reduction starts (``overlap_steps`` before
    the fragment's synchronisation), nothing on the others. A local-steps part builds its
    fragments at its first step: ask after it. Its steps count from its own first step (a part
    that ``compression="auto"`` built after its measured steps starts later than the job).
    """
    total = 0
    for schedule in opt.plans.values():
        if getattr(schedule, "reduces_every_step", True):
            total += reducer_wire_bytes(schedule.bucketed.reducer)
            continue
        every, tau = schedule.sync_every, schedule.overlap_steps
        at = schedule.position if step is None else step
        for f in schedule.fragments:
            if (at + tau) % every == f.offset:
                total += reducer_wire_bytes(f.reducer)
    return total


def commopt_wire_bytes(opt) -> int:
    """Bytes per step commopt's optimizer ``opt`` puts on the wire: a reduction's bytes for a
    part that reduces every step; for a local-steps part, the mean over a whole cycle of
    ``sync_every`` steps (every fragment once), rounded to a byte.
    """
    cycle = 1
    for schedule in opt.plans.values():
        if not getattr(schedule, "reduces_every_step", True):
            cycle = math.lcm(cycle, schedule.sync_every)
    return round(sum(commopt_sent_bytes(opt, t) for t in range(1, cycle + 1)) / cycle)
