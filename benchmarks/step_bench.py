"""Training steps side by side: PyTorch DDP and commopt on the same model, batch and link.

    commopt bench step                                   # both models, every configuration
    commopt bench step --models mlp --configs ddp-fp32,commopt-qsgd4-db --rounds 1
    python benchmarks/step_bench.py --models tiny --no-link --steps 3 --warmup 1

One job of ``-n`` ranks per model runs under ``commopt launch``: on an emulated cluster of
hosts joined by ``--link`` links, one rank per host, or on plain loopback, said so, where
network namespaces are unavailable. Inside the job every configuration gets, in turn, a
fresh model (same seed: same initial weights and batches), a fresh DDP or commopt wrapper
and optimizer, its warm-up and timed steps, and is torn down before the next. The whole
list runs ``--rounds`` times, configuration after configuration, so a change in the load
of the machine during the run hits every configuration alike; each figure is the median
over rounds of a round's median step. A job that fails (a configuration that crashes or
hangs past ``--collective-timeout``) is restarted without that configuration.

Compute-only time is measured beside every configuration: each rank also trains a twin
of the model with the plain optimizer and no communication, every rank at once, right after
each block of ``--block`` timed distributed steps (commopt's double-buffering pipeline is
drained by ``flush()`` before, and restarted by one untimed step after, which every
configuration takes so that all train the same steps). That is one
rank's throughput alone, at the same moment and under the same sharing of this machine's
cores as the distributed steps (the emulated hosts share the real CPUs, and other jobs'
load comes and goes), so efficiency and comm wait are paired measurements.

Columns of the table (one per model):

- step time: median time of a training step (forward, backward, optimizer step), and in
  brackets the lowest and highest of the rounds' medians: how much the load moved it;
- compute: median time of the twin's step (the same work without communication);
- rank CPU: processor time one rank's process (all its threads: compute, the collectives'
  worker, the transport's threads) used per step: the share of wall time it kept a core busy
  during the timed steps, times the median step. The emulated hosts share this
  machine's cores (as many cores as hosts here, not pinned): a value near or above the step
  time says the step is bound by the processor, not by the link;
- link limit: the time the link needs for this configuration's gradient allreduce,
  2(n-1)/n x wire bytes / rate: the physical limit beside the measured time;
- samples/s: n x per-rank batch / step time;
- speed-up: DDP fp32's step time / this step time;
- efficiency: e = t / (t0 n), t the samples/s of the n ranks, t0 that of one rank alone
  (the twin): compute / step time, per block, median over blocks and rounds;
- comm wait: 1 - efficiency, the share of a step spent beyond compute: waiting for the
  network and the CPU work of sending (copies, codecs);
- final loss: cross-entropy on a fixed held-out batch after the last step (first round).

The JSON (``--json``) also holds every step time, the time to the end of backward (DDP waits
for its last buckets inside backward, commopt in ``step()``), each rank's medians and losses.

Configurations: DDP fp32 (gloo), DDP with ``fp16_compress_hook``, DDP with the
PowerSGD hook at rank 1 and 4 (one bucket: see ``POWERSGD_BUCKET_MB``); commopt with fp32,
fp16, qsgd4 and qsgd4 + error feedback, each with overlap (reduction during backward) and
with double buffering (``-db``: reduction during the next step).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from commopt._importing import import_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _load_sibling(name: str):
    """Import benchmarks/<name>.py whether this file runs as a script or is loaded by path."""
    return import_file(name, HERE / f"{name}.py")


step_models = _load_sibling("step_models")
MODELS = step_models.MODELS

#: DDP bucket size for the PowerSGD hook: larger than any model here, so one bucket. On gloo
#: PowerSGD over DDP's default 25 MB buckets fails at its first compressed step (the
#: buckets' collectives interleave differently on each rank: a collective size mismatch
#: abort, or here a hang until the gloo timeout).
POWERSGD_BUCKET_MB = 4096
#: PowerSGD runs plain allreduce for its first iterations; 2 is the smallest it accepts with
#: error feedback and warm start. Warm-up steps cover them.
POWERSGD_START_ITER = 2
#: Lines a worker prints for the driver to pass on (progress); everything else goes to the log.
PROGRESS = "@step_bench "
#: Names a configuration whose last rank raises at start: tests the driver's restart.
FAIL_ENV = "COMMOPT_STEP_BENCH_FAIL"


@dataclass(frozen=True)
class StepConfig:
    """One column of the comparison."""

    name: str
    kind: str            # "ddp" or "commopt"
    wire: str            # "fp32", "fp16", "powersgd", "qsgd4", "qsgd4+ef"
    label: str
    powersgd_rank: int = 0
    double_buffering: bool = False


def _configs() -> dict[str, StepConfig]:
    out = [
        StepConfig("ddp-fp32", "ddp", "fp32", "DDP fp32"),
        StepConfig("ddp-fp16", "ddp", "fp16", "DDP fp16_compress_hook"),
        StepConfig("ddp-powersgd1", "ddp", "powersgd", "DDP PowerSGD rank 1", powersgd_rank=1),
        StepConfig("ddp-powersgd4", "ddp", "powersgd", "DDP PowerSGD rank 4", powersgd_rank=4),
    ]
    for db in (False, True):
        for wire, label in (("fp32", "fp32"), ("fp16", "fp16"), ("qsgd4", "qsgd4"),
                            ("qsgd4+ef", "qsgd4+EF")):
            mode = "double buffering" if db else "overlap"
            out.append(StepConfig(f"commopt-{wire}{'-db' if db else ''}", "commopt", wire,
                                  f"commopt {label}, {mode}", double_buffering=db))
    return {c.name: c for c in out}


CONFIGS: dict[str, StepConfig] = _configs()
#: What `commopt demo` runs: DDP fp32 against commopt's fp16, qsgd4 and double buffering.
DEMO_CONFIGS = ("ddp-fp32", "commopt-fp16", "commopt-qsgd4", "commopt-fp16-db",
                "commopt-qsgd4+ef-db")


# ---------------------------------------------------------------------------------------------
# arithmetic (pure: tested in tests/unit/test_step_bench.py)

def parse_rate(text: str) -> float:
    """Bits per second from tc-style text: ``1gbit``, ``100mbit``, ``2.5gbit``, ``1000000``."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    t = text.strip().lower()
    for suffix, factor in units.items():
        if t.endswith(suffix):
            t = t[: -len(suffix)]
            break
    else:
        factor = 1.0
    try:
        return float(t) * factor
    except ValueError:
        raise ValueError(f"cannot read the link rate {text!r}: write it like 1gbit or 100mbit") from None


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
    numel = sum(math.prod(s) for s in shapes)
    if config.wire == "fp32":
        return 4 * numel
    if config.wire == "fp16":
        return 2 * numel
    if config.wire == "powersgd":
        return powersgd_wire_bytes(shapes, config.powersgd_rank)
    raise ValueError(f"DDP has no wire format {config.wire!r}")


def efficiency(step_s: float, compute_s: float) -> float:
    """e = t / (t0 n) with t = n B / step_s and t0 = B / compute_s: compute_s / step_s."""
    return compute_s / step_s


def comm_wait_share(step_s: float, compute_s: float) -> float:
    """Share of a step spent beyond compute-only time (waiting for the network), in [0, 1)."""
    return max(0.0, step_s - compute_s) / step_s


def robust_step(rounds: list[dict], key: str = "step_times") -> float | None:
    """Median over rounds of each round's median: one slow round cannot move it far."""
    medians = [statistics.median(r[key]) for r in rounds if r.get(key)]
    return statistics.median(medians) if medians else None


def cpu_share(rounds: list[dict]) -> float | None:
    """Cores one rank kept busy during its timed steps: CPU seconds / wall seconds, median over
    rounds (None for reports from before the CPU was recorded).

    A mean over the blocks' CPU per step against the mean step time, not the median step: a
    slow step's CPU is counted with its own duration.
    """
    shares = [statistics.fmean(r["cpu_per_step"]) / statistics.fmean(r["step_times"])
              for r in rounds if r.get("cpu_per_step") and r.get("step_times")]
    return statistics.median(shares) if shares else None


@dataclass
class Row:
    """One configuration's measured and derived figures."""

    config: str
    label: str
    kind: str
    step_s: float | None = None
    step_rounds: list[float] | None = None  # each round's median step time
    compute_s: float | None = None
    samples_per_s: float | None = None
    speedup: float | None = None
    efficiency: float | None = None
    comm_wait: float | None = None
    limit_s: float | None = None
    wire_bytes: int | None = None
    final_loss: float | None = None
    backward_s: float | None = None
    cpu_s: float | None = None     # one rank's process CPU time (all threads) per step
    cpu_busy: float | None = None  # that CPU time / wall time during the timed steps (cores)
    ranks_agree: bool | None = None
    error: str | None = None


def summarize(results: dict[str, dict], n: int, rate_bits: float | None) -> list[Row]:
    """Rows in the order of ``results`` (config name -> merged result, or {"error": ...}).

    A merged result has ``rounds`` (each with ``step_times``, ``compute_times``,
    ``backward_times``, ``eval_loss``), ``batch``, ``wire_bytes``, ``ranks_agree``. Speed-up
    is against ``ddp-fp32`` when it ran (else empty); efficiency and comm wait against the
    configuration's own compute-only time.
    """
    base = results.get("ddp-fp32")
    base_step = robust_step(base["rounds"]) if base and "error" not in base else None
    rows = []
    for name, r in results.items():
        cfg = CONFIGS[name]
        row = Row(name, cfg.label, cfg.kind)
        if "error" in r:
            row.error = r["error"]
            rows.append(row)
            continue
        row.step_s = robust_step(r["rounds"])
        row.step_rounds = [statistics.median(rd["step_times"]) for rd in r["rounds"]]
        row.compute_s = robust_step(r["rounds"], "compute_times")
        row.backward_s = robust_step(r["rounds"], "backward_times")
        row.cpu_busy = cpu_share(r["rounds"])
        if row.cpu_busy is not None:  # CPU per step at the median step: its share of the wall time
            row.cpu_s = row.cpu_busy * row.step_s
        row.samples_per_s = n * r["batch"] / row.step_s
        row.final_loss = r["rounds"][0].get("eval_loss")
        row.wire_bytes = r.get("wire_bytes")
        row.ranks_agree = r.get("ranks_agree")
        if base_step is not None:
            row.speedup = base_step / row.step_s
        if row.wire_bytes is not None:
            row.limit_s = allreduce_limit_s(row.wire_bytes, n, rate_bits)
        paired = [e for rd in r["rounds"] for e in (rd.get("block_efficiency") or [])]
        if paired:  # each block against the compute-only steps right after it
            row.efficiency = statistics.median(paired)
            row.comm_wait = max(0.0, 1.0 - row.efficiency)
        elif row.compute_s is not None:
            row.efficiency = efficiency(row.step_s, row.compute_s)
            row.comm_wait = comm_wait_share(row.step_s, row.compute_s)
        rows.append(row)
    return rows


def check_targets(role: str, rows: list[Row]) -> list[str]:
    """The issue's targets for a model of ``role`` ("communication" or "compute"), met or not."""
    ok = [r for r in rows if r.step_s is not None]
    commopt = [r for r in ok if r.kind == "commopt"]
    if not commopt:
        return []
    lines = []
    if role == "communication":
        best = min(commopt, key=lambda r: r.step_s)
        if best.speedup is not None:
            lines.append(f"best commopt ({best.config}) is {best.speedup:.2f}x faster per step "
                         f"than DDP fp32 (target >= 5x: {'met' if best.speedup >= 5 else 'NOT met'})")
        hooks = [r for r in ok if r.kind == "ddp" and r.config != "ddp-fp32"]
        if hooks:
            hook = min(hooks, key=lambda r: r.step_s)
            ratio = hook.step_s / best.step_s
            lines.append(f"best commopt is {ratio:.2f}x faster than the best DDP hook "
                         f"({hook.config}, {hook.step_s * 1e3:.0f} ms) "
                         f"(target >= 1.3x: {'met' if ratio >= 1.3 else 'NOT met'})")
            if best.cpu_s is not None and best.limit_s is not None:
                bound = "the processor" if best.cpu_busy >= 0.8 and best.cpu_s > best.limit_s else "the link"
                lines.append(f"best commopt's rank keeps {best.cpu_busy:.2f} cores busy "
                             f"({best.cpu_s * 1e3:.0f} ms of CPU per {best.step_s * 1e3:.0f} ms step) "
                             f"against a link limit of {best.limit_s * 1e3:.0f} ms: bound by {bound}")
    elif role == "compute":
        eff = [r for r in commopt if r.efficiency is not None]
        if eff:
            best = max(eff, key=lambda r: r.efficiency)
            lines.append(f"best commopt scaling efficiency {best.efficiency:.0%} ({best.config}) "
                         f"(target >= 90%: {'met' if best.efficiency >= 0.9 else 'NOT met'})")
    return lines


def _fmt(value, spec, unit=""):
    return "-" if value is None else format(value, spec) + unit


TABLE_COLUMNS = ("configuration", "step ms (rounds)", "compute ms", "rank CPU ms", "link limit ms",
                 "samples/s", "speed-up", "efficiency", "comm wait", "final loss")


def table_cells(row: Row) -> list[str]:
    if row.error:
        lines = [ln for ln in row.error.splitlines() if ln.strip()]
        why = lines[-1].split("]:", 1)[-1].strip()[:70]  # the exception, not the log path
        return [row.config, "failed: " + why] + [""] * (len(TABLE_COLUMNS) - 2)
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    pct = lambda v: None if v is None else v * 100  # noqa: E731
    step = _fmt(ms(row.step_s), ".0f")
    if row.step_rounds and len(row.step_rounds) > 1:
        step += f" ({min(row.step_rounds) * 1e3:.0f}-{max(row.step_rounds) * 1e3:.0f})"
    return [row.config, step, _fmt(ms(row.compute_s), ".0f"), _fmt(ms(row.cpu_s), ".0f"),
            _fmt(ms(row.limit_s), ".0f"), _fmt(row.samples_per_s, ".1f"),
            _fmt(row.speedup, ".2f", "x"), _fmt(pct(row.efficiency), ".0f", "%"),
            _fmt(pct(row.comm_wait), ".0f", "%"), _fmt(row.final_loss, ".4f")]


def format_table(rows: list[Row]) -> str:
    """A plain-text table, columns aligned."""
    cells = [list(TABLE_COLUMNS)] + [table_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(TABLE_COLUMNS))]
    lines = []
    for k, c in enumerate(cells):
        lines.append("  ".join(s.ljust(w) if i == 0 else s.rjust(w)
                               for i, (s, w) in enumerate(zip(c, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[Row]) -> str:
    head = "| " + " | ".join(TABLE_COLUMNS) + " |"
    sep = "|" + "|".join(["---"] + ["---:"] * (len(TABLE_COLUMNS) - 1)) + "|"
    body = ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def merge_rounds(entries: list[dict]) -> dict:
    """One configuration's runs (every rank, every round) -> the merged result ``summarize`` reads.

    ``entries`` are the worker's records: config, round, rank, size, batch, step_times,
    compute_times, backward_times, cpu_per_step (optional), losses, eval_loss, checksum,
    wire_bytes, params.
    """
    by_round: dict[int, dict[int, dict]] = {}
    for e in entries:
        by_round.setdefault(e["round"], {})[e["rank"]] = e
    rounds, agree = [], True
    for k in sorted(by_round):
        ranks = by_round[k]
        first = ranks[min(ranks)]
        rounds.append({key: first.get(key) for key in ("step_times", "compute_times",
                                                       "block_efficiency", "backward_times",
                                                       "cpu_per_step", "losses", "eval_loss")})
        rounds[-1]["rank_step_medians"] = [statistics.median(ranks[r]["step_times"])
                                           for r in sorted(ranks)]
        agree = agree and len({ranks[r]["checksum"] for r in ranks}) == 1
    first = entries[0]
    return {"rounds": rounds, "batch": first["batch"], "size": first["size"],
            "wire_bytes": first["wire_bytes"], "params": first["params"], "ranks_agree": agree}


# ---------------------------------------------------------------------------------------------
# worker: one rank of a job that runs a schedule of configurations

def _worker(args: argparse.Namespace) -> int:
    import torch

    import commopt

    torch.set_num_threads(args.threads)
    if not args.system_malloc:
        # Every configuration alike: freed gradients and activations are reused instead of
        # page-faulted back each step (see commopt.memory; PyTorch's tuning guide).
        commopt.reuse_freed_memory()
    if args.comm == "mpi":
        comm = commopt.create_communicator("mpi")
        # DDP needs torch.distributed too; under mpirun it finds its peers through MPI.
        gloo = commopt.create_communicator("torch", timeout_s=args.collective_timeout)
    else:
        comm = gloo = commopt.create_communicator("torch", timeout_s=args.collective_timeout)
    spec = MODELS[args.model]
    schedule = args.worker.split(",")
    records: list[dict] = []
    out = Path(f"{args.result}.rank{comm.rank}")
    for index, name in enumerate(schedule):
        cfg = CONFIGS[name]
        if comm.rank == 0:
            print(f"{PROGRESS}start {index} {name}", flush=True)
        rec = _run_config(cfg, spec, comm, gloo, args)
        rec.update(index=index, config=name, kind=cfg.kind, rank=comm.rank, size=comm.size)
        records.append(rec)
        out.write_text(json.dumps(records))  # after each one: a later failure keeps these
        if comm.rank == 0:
            print(f"{PROGRESS}done {index} {name} {statistics.median(rec['step_times']):.6f} "
                  f"{rec['eval_loss']:.6f}", flush=True)
    gloo.allgather_obj(None)  # nobody tears down while a peer still reads
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _run_config(cfg: StepConfig, spec, comm, gloo, args) -> dict:
    """Build, warm up, time and tear down one configuration on this rank."""
    import torch
    import torch.nn.functional as F

    rank = comm.rank
    if os.environ.get(FAIL_ENV) == cfg.name and rank == comm.size - 1:
        raise RuntimeError(f"failure injected into {cfg.name} (${FAIL_ENV})")
    batch = args.batch or spec.batch_size
    torch.manual_seed(args.seed)
    model = spec.build()
    shapes = step_models.param_shapes(model)
    inner = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
    net, opt, wire_bytes = model, inner, 0
    if cfg.kind == "ddp":
        net, wire_bytes = _wrap_ddp(model, cfg), ddp_wire_bytes(cfg, shapes)
    elif cfg.kind == "commopt":
        opt = _wrap_commopt(inner, comm, model, cfg)
        wire_bytes = _commopt_wire_bytes(opt)
    # The compute-only twin: the same model and optimizer, no communication.
    torch.manual_seed(args.seed)
    twin = spec.build()
    twin_opt = torch.optim.SGD(twin.parameters(), lr=spec.lr, momentum=0.9)
    steps = args.steps or spec.steps
    block = min(args.block or spec.block, steps)
    n_blocks = -(-steps // block)
    # Double buffering restarts its pipeline after each pause: one untimed step per block,
    # for every configuration so that all train the same number of steps.
    restarts = n_blocks - 1
    batches = [spec.batch(step=i, rank=rank, size=batch)
               for i in range(args.warmup + steps + restarts)]
    feed = iter(batches)
    step_times, backward_times, losses, compute_times, block_eff = [], [], [], [], []
    block_cpu = []  # this process's CPU seconds (every thread) per timed step, per block

    def train_step(timed: bool) -> None:
        x, y = next(feed)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        after_backward = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        losses.append(float(loss.detach()))
        if timed:
            step_times.append(end - start)
            backward_times.append(after_backward - start)

    def twin_step(j: int) -> float:
        x, y = batches[args.warmup + j % steps]
        start = time.perf_counter()
        twin_opt.zero_grad(set_to_none=True)
        F.cross_entropy(twin(x), y).backward()
        twin_opt.step()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        train_step(timed=False)
    twin_step(0)  # the twin's warm-up
    for b in range(n_blocks):
        count = min(block, steps - b * block)
        if b > 0:
            train_step(timed=False)
        gloo.allgather_obj(None)  # every rank starts the timed steps together
        first = len(step_times)
        cpu_start = time.process_time()
        for _ in range(count):
            train_step(timed=True)
        block_cpu.append((time.process_time() - cpu_start) / count)
        if cfg.kind == "commopt":
            opt.flush()  # double buffering: apply the last averaged gradients (untimed)
        # Right after, with nothing in flight: every rank computes alone, all at once.
        gloo.allgather_obj(None)
        twins = [twin_step(j) for j in range(args.compute_steps or count)]
        compute_times += twins
        block_eff.append(statistics.median(twins) / statistics.median(step_times[first:]))
    with torch.no_grad():
        ex, ey = spec.eval_batch()
        eval_loss = float(F.cross_entropy(model(ex), ey))
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    if cfg.kind == "commopt":
        opt.close()
    del net, opt, inner, model, twin, twin_opt
    gc.collect()
    gloo.allgather_obj(None)  # the next configuration starts on every rank together
    return {"batch": batch, "step_times": step_times, "compute_times": compute_times,
            "block_efficiency": block_eff, "backward_times": backward_times, "losses": losses,
            "cpu_per_step": block_cpu,
            "eval_loss": eval_loss, "checksum": checksum, "wire_bytes": wire_bytes,
            "params": sum(math.prod(s) for s in shapes)}


def _wrap_ddp(model, cfg: StepConfig):
    from torch.nn.parallel import DistributedDataParallel as DDP

    if cfg.wire == "fp32":
        return DDP(model)
    if cfg.wire == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp = DDP(model)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    ddp = DDP(model, bucket_cap_mb=POWERSGD_BUCKET_MB)  # one bucket: see POWERSGD_BUCKET_MB
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                   start_powerSGD_iter=POWERSGD_START_ITER)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return ddp


def _wrap_commopt(inner, comm, model, cfg: StepConfig):
    import commopt

    kwargs = {}
    if cfg.wire == "fp16":
        kwargs["allreduce_grad_dtype"] = "float16"   # every gradient in 16 bits, as DDP's hook
    elif cfg.wire.startswith("qsgd"):
        kwargs["compression"] = cfg.wire
    return commopt.create_multi_node_optimizer(inner, comm, double_buffering=cfg.double_buffering,
                                               overlap=True, model=model, **kwargs)


def _commopt_wire_bytes(opt) -> int:
    return int(sum(b.codec.encoded_nbytes(b.numel) if b.codec is not None else 4 * b.numel
                   for b in opt.buckets))


# ---------------------------------------------------------------------------------------------
# driver: one job per model; restarted without a configuration that fails

@dataclass
class LinkPlan:
    rate_bits: float | None   # None: unshaped loopback
    link_arg: str | None      # what goes to `commopt launch --link`
    description: str


def plan_link(link: str | None) -> LinkPlan:
    """Emulated hosts joined by ``link`` if namespaces work here, else plain loopback, said so."""
    if link is None:
        return LinkPlan(None, None, "plain loopback (unshaped: --no-link)")
    rate = parse_rate(link)
    from commopt.testbed import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        return LinkPlan(None, None, f"plain loopback, unshaped: no emulated {link} link here "
                                    f"because {reason}")
    return LinkPlan(rate, link, f"emulated hosts joined by {link} links (tc tbf, network namespaces)")


def _job_argv(args, plan: LinkPlan, model: str, schedule: list[str], result: Path,
              threads: int) -> list[str]:
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(schedule),
              "--model", model, "--warmup", str(args.warmup), "--threads", str(threads),
              "--seed", str(args.seed), "--comm", args.comm,
              "--collective-timeout", str(args.collective_timeout), "--result", str(result)]
    if args.steps:
        worker += ["--steps", str(args.steps)]
    if args.batch:
        worker += ["--batch", str(args.batch)]
    if args.compute_steps:
        worker += ["--compute-steps", str(args.compute_steps)]
    if args.system_malloc:
        worker += ["--system-malloc"]
    if args.block:
        worker += ["--block", str(args.block)]
    argv = [sys.executable, "-m", "commopt", "launch", "-n", str(args.nprocs),
            "--launcher", args.launcher, "--timeout", str(args.timeout)]
    if plan.link_arg:
        argv += ["--link", plan.link_arg]
    return argv + ["--", *worker]


def _run_job(args, plan, model, schedule, workdir: Path, attempt: int, threads: int,
             report_line) -> tuple[list[dict], int | None, str | None]:
    """Run ``schedule`` in one job: (records of every rank, index that failed, why).

    The index is None with a reason when the job failed before any configuration started
    (the launcher itself, or the ranks' start-up): restarting would not help.
    """
    result = workdir / f"{model}-{attempt}.json"
    log = workdir / f"{model}-{attempt}.log"
    argv = _job_argv(args, plan, model, schedule, result, threads)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    current, started = None, False
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                text=True, errors="replace")
        for line in proc.stdout:
            out.write(line)
            if line.startswith(PROGRESS):
                word, index, name, *rest = line[len(PROGRESS):].split()
                current = int(index) if word == "start" else None
                started = True
                if word == "done":
                    report_line(int(index), name, float(rest[0]), float(rest[1]))
        rc = proc.wait()
    records = []
    for r in range(args.nprocs):
        path = Path(f"{result}.rank{r}")
        if path.exists():
            records += json.loads(path.read_text())
    if rc == 0:
        return records, None, None
    why = "timed out" if rc == 124 else f"exit code {rc}"
    why = f"{why} (log {log}):\n{root_cause(log.read_text(errors='replace'))}"
    if not started:
        return records, None, why
    done = {e["index"] for e in records if e["rank"] == 0}
    failed = current if current is not None else next(
        (i for i in range(len(schedule)) if i not in done), 0)
    return records, failed, why


def root_cause(log: str, lines: int = 10) -> str:
    """The end of the failing rank's traceback in a job's log (else the log's last lines).

    ``commopt launch`` names the rank that failed first; torch prefixes each line of an
    uncaught error with ``[rankN]:``. The other ranks' errors (a peer closed the connection)
    are consequences, not the cause.
    """
    import re

    text = log.strip().splitlines()
    first = re.search(r"rank (\d+) ended with", log)
    if first:
        mine = [ln for ln in text if ln.startswith(f"[rank{first.group(1)}]:")]
        if mine:
            return "\n".join(mine[-lines:])
    return "\n".join(text[-lines:])


def run_model(args, plan: LinkPlan, model: str, configs: list[str], workdir: Path,
              threads: int) -> dict[str, dict]:
    """Every configuration of ``model``, ``args.rounds`` times: config -> merged result."""
    schedule = [c for _ in range(args.rounds) for c in configs]
    records: list[dict] = []
    errors: dict[str, str] = {}
    pending = list(range(len(schedule)))  # indices into ``schedule`` not run yet
    attempt = 0
    total = len(schedule)

    def report_line(local, name, step_s, loss):
        k = pending_at_start[local]
        print(f"[{k + 1}/{total}] {model} {name}: {step_s * 1e3:.0f} ms/step, "
              f"final loss {loss:.4f}", flush=True)

    while pending:
        pending_at_start = list(pending)
        got, failed, why = _run_job(args, plan, model, [schedule[i] for i in pending], workdir,
                                    attempt, threads, report_line)
        for e in got:  # the job numbered its own schedule: back to this run's numbering
            e["index"] = pending_at_start[e["index"]]
            e["round"] = e["index"] // len(configs)
        records += got
        if failed is None:
            if why is not None:  # the job could not start: what never ran fails with it
                ran = {e["config"] for e in records}
                for i in pending:
                    if schedule[i] not in ran:
                        errors.setdefault(schedule[i], why)
                print(f"{model}: the job failed before its first configuration: {why}", flush=True)
            break
        bad = schedule[pending_at_start[failed]]
        errors[bad] = why
        print(f"{model} {bad}: FAILED, {why}\n(restarting the job without {bad})", flush=True)
        done = {e["index"] for e in got if e["rank"] == 0}
        pending = [i for i in pending_at_start if i not in done and schedule[i] != bad]
        attempt += 1
    results = {}
    for name in configs:
        mine = [e for e in records if e["config"] == name]
        if name in errors:
            results[name] = {"error": errors[name]}
        elif mine:
            results[name] = merge_rounds(mine)
        else:
            results[name] = {"error": "did not run"}
    return results


def _threads_per_rank(nprocs: int) -> int:
    # The emulated hosts share this machine's cores: one share each.
    return max(1, (os.cpu_count() or 1) // nprocs)


def _machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def run_driver(args: argparse.Namespace) -> dict:
    """Run every (model, configuration); print and return the report."""
    import torch

    models = _split(args.models, MODELS, "model")
    configs = _split(args.configs, CONFIGS, "configuration")
    try:
        plan = plan_link(None if args.no_link else args.link)
    except ValueError as exc:
        raise SystemExit(f"step_bench: {exc}") from None
    threads = args.threads or _threads_per_rank(args.nprocs)
    report = {
        "command": _command_line(args), "link": plan.description, "link_rate": plan.link_arg,
        "rate_bits": plan.rate_bits, "nprocs": args.nprocs, "threads_per_rank": threads,
        "launcher": args.launcher, "commopt_comm": args.comm, "machine": _machine(),
        "torch": torch.__version__, "load_average_start": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M"), "warmup": args.warmup, "rounds": args.rounds,
        "models": {},
    }
    print(f"step benchmark: {args.nprocs} ranks, {plan.description}; {threads} thread(s) per "
          f"rank; {args.rounds} round(s) of every configuration, {args.warmup} warm-up steps "
          f"each", flush=True)
    with tempfile.TemporaryDirectory(prefix="commopt-step-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for model in models:
            spec = MODELS[model]
            results = run_model(args, plan, model, configs, workdir, threads)
            rows = summarize(results, args.nprocs, plan.rate_bits)
            params = next((r["params"] for r in results.values() if "params" in r), None)
            fp32_limit = allreduce_limit_s(4 * params, args.nprocs, plan.rate_bits) if params else None
            report["models"][model] = {
                "description": spec.description, "role": spec.role, "params": params,
                "batch_per_rank": args.batch or spec.batch_size, "steps": args.steps or spec.steps,
                "fp32_allreduce_limit_s": fp32_limit, "rows": [vars(r) for r in rows],
                "raw": results, "targets": check_targets(spec.role, rows),
            }
            _print_model(model, report["models"][model], rows, args.nprocs, plan,
                         targets=not getattr(args, "hide_targets", False))
    report["load_average_end"] = os.getloadavg()[0]
    _write_outputs(report, args)
    return report


def rerender(args: argparse.Namespace) -> dict:
    """Recompute the tables of a saved ``--json`` report (``--from-json``) and write them again."""
    report = json.loads(Path(args.from_json).read_text())
    plan = LinkPlan(report["rate_bits"], report.get("link_rate"), report["link"])
    for model, info in report["models"].items():
        rows = summarize(info["raw"], report["nprocs"], report["rate_bits"])
        info["rows"] = [vars(r) for r in rows]
        info["targets"] = check_targets(info["role"], rows)
        info.setdefault("steps", MODELS[model].steps)
        _print_model(model, info, rows, report["nprocs"], plan)
    report.setdefault("rounds", max(len(r.get("rounds", [])) for info in report["models"].values()
                                    for r in info["raw"].values()))
    _write_outputs(report, args)
    return report


def _write_outputs(report: dict, args) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(markdown_report(report))
        print(f"wrote {args.markdown}")
    if getattr(args, "sim_measurements", None):
        try:
            entries = sim_measurements(report)
        except ValueError as exc:
            raise SystemExit(f"step_bench: {exc}") from None
        Path(args.sim_measurements).write_text(json.dumps(entries, indent=1) + "\n")
        print(f"wrote {args.sim_measurements} ({len(entries)} entries)")
    if args.plot:
        try:
            plot_step_times(report, args.plot)
            print(f"wrote {args.plot}")
        except ImportError as exc:  # the tables matter more than the picture
            print(f"no plot: {exc}")


#: Why the simulator cannot predict a configuration (its rows are written, flagged, not counted).
SIM_NOT_MODELLED = {
    "powersgd": ("PowerSGD (low-rank factorisation, with its own CPU work per step): the simulator has no "
                 "low-rank codec"),
}


def sim_measurements(report: dict) -> list[dict]:
    """Entries for ``benchmarks/sim_validation.py --measured``: one per (model, configuration)
    that ran (fields of ``commopt.sim.validation.Measurement``).

    Compute is the twin's median step (no communication, same moment and cores), gradient
    bytes the fp32 gradient, the measured step the median over rounds of each round's median.
    The plan is what ran: DDP sums with gloo's ring in 25 MiB buckets (torch counts
    ``bucket_cap_mb`` in MiB), fp16 through ``fp16_compress_hook``; commopt's fp32/fp16 buckets
    (25 MiB) go through its transport's ring, qsgd4 through its pipelined scatter-reduce/
    allgather ("sra"); overlap is "backward" (buckets sent during backward) or, for ``-db``,
    "double-buffering". PowerSGD rows carry ``not_modelled`` (the reason).

        >>> r = {"command": "c", "nprocs": 2, "rate_bits": 1e9, "commopt_comm": "torch", "models": {
        ...     "m": {"params": 10, "rows": [{"config": "commopt-qsgd4-db", "error": None, "step_s": 0.2,
        ...     "step_rounds": [0.2, 0.3], "compute_s": 0.1}]}}}
        >>> e = sim_measurements(r)[0]
        >>> e["plan"]["algorithm"], e["plan"]["codec"], e["plan"]["overlap"], e["grad_bytes"], e["transport"]
        ('sra', 'qsgd4', 'double-buffering', 40, 'torch')
    """
    from commopt.collectives import PIECE_BYTES

    if not report.get("rate_bits"):
        raise ValueError("--sim-measurements needs a run on the emulated link (this report ran on "
                         "unshaped loopback): rerun with --link RATE")
    loads = [v for v in (report.get("load_average_start"), report.get("load_average_end")) if v is not None]
    out = []
    for model, info in report["models"].items():
        for row in info["rows"]:
            if row.get("error") or row.get("step_s") is None or row.get("compute_s") is None:
                continue
            cfg = CONFIGS[row["config"]]
            rounds = row.get("step_rounds") or [row["step_s"]]
            plan = {"algorithm": "sra" if cfg.wire.startswith("qsgd") else "ring",
                    "codec": "none" if cfg.wire == "fp32" else cfg.wire,
                    "overlap": "double-buffering" if cfg.double_buffering else "backward", "bucket_mb": 25.0}
            if cfg.wire.startswith("qsgd"):
                plan["piece_mb"] = PIECE_BYTES / 2**20  # the pipeline's pieces, as they ran
            if cfg.wire == "powersgd":
                plan.update(codec=f"powersgd{cfg.powersgd_rank}", bucket_mb=float(POWERSGD_BUCKET_MB))
            transport = "torch" if cfg.kind == "ddp" else report.get("commopt_comm", "torch")
            entry = {
                "what": f"step {model} {row['config']}, {report['nprocs']} hosts x 1 rank, "
                        f"{report['rate_bits'] / 1e9:g} Gbit/s (median of {len(rounds)} rounds)",
                "command": report["command"], "gpus": report["nprocs"], "compute_s": row["compute_s"],
                "grad_bytes": 4 * info["params"], "measured_step_s": row["step_s"], "plan": plan,
                "transport": transport, "link_bits_per_s": report["rate_bits"], "rounds": len(rounds),
                "measured_min_s": min(rounds), "measured_max_s": max(rounds)}
            if loads:
                entry["load_average"] = [min(loads), max(loads)]
            if row.get("cpu_s") is not None:
                entry["measured_cpu_s"] = row["cpu_s"]
            if cfg.wire in SIM_NOT_MODELLED:
                entry["not_modelled"] = SIM_NOT_MODELLED[cfg.wire]
            out.append(entry)
    return out


def _command_line(args) -> str:
    """How this run was started, for the record."""
    if getattr(args, "command_line", None):  # set by a caller such as `commopt demo`
        return args.command_line
    if getattr(args, "argv", None) is not None:  # run as a script
        return " ".join(["python", "benchmarks/step_bench.py", *map(shlex.quote, args.argv)])
    argv = sys.argv[1:]
    if argv[:2] == ["bench", "step"]:
        return " ".join(["commopt", *map(shlex.quote, argv)])
    return "commopt bench step (from " + " ".join(map(shlex.quote, sys.argv)) + ")"


def _split(text: str, valid: dict, what: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in valid]
    if bad or not names:
        raise SystemExit(f"step_bench: unknown {what} {', '.join(bad) or '(none given)'}; "
                         f"choose from {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise SystemExit(f"step_bench: a {what} is named twice in {text!r}")
    return names


def _print_model(model: str, info: dict, rows: list[Row], n: int, plan: LinkPlan,
                 targets: bool = True) -> None:
    print(f"\n{model}: {info['description']}; batch {info['batch_per_rank']} per rank, {n} ranks")
    print(format_table(rows))
    if info["fp32_allreduce_limit_s"] is not None:
        print(f"physical limit: the fp32 gradient ({info['params'] * 4 / 1e6:.1f} MB) needs "
              f"{info['fp32_allreduce_limit_s'] * 1e3:.0f} ms per allreduce on this link "
              f"(2(n-1)/n x bytes / rate)")
    else:
        print(f"link: {plan.description}; no physical limit to compare with")
    for row in rows:
        if row.ranks_agree is False:
            print(f"warning: {row.config}: the ranks' parameters differ after training")
    for line in info["targets"] if targets else []:
        print("target: " + line)
    print(flush=True)


def markdown_report(report: dict) -> str:
    """The results as markdown: the command, the link, one table per model, the targets."""
    out = [f"Command: `{report['command']}`", "",
           f"Link: {report['link']}; {report['nprocs']} ranks, one per host; "
           f"{report['threads_per_rank']} thread(s) per rank; machine: {report['machine']}; "
           f"torch {report['torch']}; load average {report['load_average_start']:.1f} at the "
           f"start, {report['load_average_end']:.1f} at the end; {report['date']}.", ""]
    for model, info in report["models"].items():
        rows = [Row(**r) for r in info["rows"]]
        out += [f"### {model}: {info['description']}", "",
                f"Batch {info['batch_per_rank']} per rank; {report['rounds']} round(s), each "
                f"{report['warmup']} warm-up and {info['steps']} timed steps per configuration; "
                f"median over rounds of each round's median.", "", markdown_table(rows), ""]
        if info["fp32_allreduce_limit_s"] is not None:
            out += [f"Physical limit: the fp32 gradient ({info['params'] * 4 / 1e6:.1f} MB) "
                    f"needs {info['fp32_allreduce_limit_s'] * 1e3:.0f} ms per allreduce on this "
                    f"link.", ""]
        out += [f"- target: {t}" for t in info["targets"]] + [""]
    return "\n".join(out)


def plot_step_times(report: dict, path: str) -> None:
    """Bar chart of step time per configuration, one panel per model."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the step-time plot needs matplotlib: pip install matplotlib "
                          "(or commopt[plot])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5.8), squeeze=False)
    colors = {"ddp": "#d95f02", "commopt": "#1b9e77"}
    for ax, model in zip(axes[0], models):
        info = report["models"][model]
        rows = [r for r in info["rows"] if r["step_s"] is not None][::-1]
        names = [r["config"] for r in rows]
        ax.barh(names, [r["step_s"] * 1e3 for r in rows], color=[colors[r["kind"]] for r in rows])
        ax.barh(names, [(r["compute_s"] or 0) * 1e3 for r in rows], height=0.3, color="#333333",
                label="compute only (same moment, no communication)")
        for y, r in enumerate(rows):
            if r["speedup"] is not None:
                right = max(r["step_s"], r["compute_s"] or 0) * 1e3
                ax.annotate(f"{r['speedup']:.1f}x", (right, y), xytext=(3, -3),
                            textcoords="offset points", fontsize=8)
        if info["fp32_allreduce_limit_s"]:
            ax.axvline(info["fp32_allreduce_limit_s"] * 1e3, ls="--", color="k", lw=1,
                       label="fp32 allreduce, link limit")
        ax.set_xlabel("step time, ms (median; label: speed-up over ddp-fp32)")
        params = f"{info['params'] / 1e6:.2f}M params, " if info.get("params") else ""
        ax.set_title(f"{model}: {params}batch {info['batch_per_rank']}/rank", fontsize=10)
        ax.margins(x=0.12)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2)
    fig.suptitle(f"{report['nprocs']} ranks, {report['link']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `commopt bench step` (and of this script)."""
    parser.add_argument("--models", default="mlp,cnn",
                        help=f"comma-separated, from {', '.join(MODELS)} (default mlp,cnn)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated configurations (default: all): " + ", ".join(CONFIGS))
    parser.add_argument("-n", "--nprocs", type=int, default=2, help="ranks, one per host (default 2)")
    parser.add_argument("--link", default="1gbit",
                        help="rate of the emulated links between hosts (default 1gbit; needs root "
                             "and network namespaces, else plain loopback, said so)")
    parser.add_argument("--no-link", action="store_true", help="run on plain loopback, unshaped")
    parser.add_argument("--launcher", choices=("torch", "mpi"), default="torch",
                        help="how `commopt launch` starts the ranks (default torch)")
    parser.add_argument("--comm", choices=("torch", "mpi"), default="torch",
                        help="commopt's communicator: torch (gloo, DDP's transport; default) or mpi "
                             "(needs --launcher mpi)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times the whole list of configurations runs, in turn (default 3)")
    parser.add_argument("--steps", type=int,
                        help="timed steps per configuration and round (default: the model's: "
                             + ", ".join(f"{m} {s.steps}" for m, s in MODELS.items()) + ")")
    parser.add_argument("--warmup", type=int, default=3,
                        help=f"untimed steps first (default 3; PowerSGD compresses from step "
                             f"{POWERSGD_START_ITER})")
    parser.add_argument("--block", type=int,
                        help="timed steps between two compute-only measurements (default: the "
                             "model's: " + ", ".join(f"{m} {s.block}" for m, s in MODELS.items()) + ")")
    parser.add_argument("--compute-steps", type=int,
                        help="compute-only steps after each block (default: the block's size)")
    parser.add_argument("--batch", type=int, help="per-rank batch (default: the model's)")
    parser.add_argument("--threads", type=int,
                        help="torch threads per rank (default cores / ranks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc malloc as it is (default: every rank calls "
                             "commopt.reuse_freed_memory(), for every configuration alike)")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds one model's job may take (default 3600)")
    parser.add_argument("--collective-timeout", type=float, default=300,
                        help="seconds a rank waits in one collective before the job fails and "
                             "restarts without that configuration (default 300)")
    parser.add_argument("--json", metavar="PATH", help="write every figure and raw timing as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables as markdown")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of step time per configuration")
    parser.add_argument("--workdir", help="keep each job's log and JSON here")
    parser.add_argument("--from-json", metavar="PATH",
                        help="run nothing: recompute and write the tables and plot of a report "
                             "saved with --json")
    parser.add_argument("--sim-measurements", metavar="PATH",
                        help="write one simulator measurement entry per (model, configuration) for "
                             "benchmarks/sim_validation.py --measured (with --from-json or after a run)")
    # Internal: one rank of a job running a schedule of configurations (the driver starts them).
    parser.add_argument("--worker", metavar="SCHEDULE", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark (or, with --worker, one rank of one job)."""
    if args.worker:
        return _worker(args)
    if args.from_json:
        rerender(args)
        return 0
    if args.comm == "mpi" and args.launcher != "mpi":
        raise SystemExit("step_bench: --comm mpi needs --launcher mpi")
    if args.nprocs < 2:
        raise SystemExit("step_bench: -n must be at least 2 (every configuration measures its "
                         "own 1-rank compute time)")
    if any(v is not None and v < 1 for v in (args.steps, args.compute_steps, args.block)) \
            or args.warmup < 0 or args.rounds < 1:
        raise SystemExit("step_bench: need --steps, --block and --compute-steps >= 1, "
                         "--warmup >= 0 and --rounds >= 1")
    report = run_driver(args)
    failed = [f"{m}/{r['config']}" for m, info in report["models"].items()
              for r in info["rows"] if r["error"]]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    _args = _parser.parse_args()
    _args.argv = sys.argv[1:]
    raise SystemExit(main(_args))
