"""One rank of a step-benchmark job: every configuration of its schedule in turn.

The driver starts each rank as ``python -m commopt.bench.step --worker SCHEDULE ...`` under
``commopt launch``. Each configuration gets a fresh model (same seed: same initial weights and
batches), a fresh DDP or commopt wrapper and optimizer, its warm-up and timed steps, and, after
each block of ``--block`` timed steps, the compute-only steps of a twin of the model with the
plain optimizer and no communication (every rank at once: one rank's throughput alone, at the
same moment and under the same sharing of the machine's cores). The records go to
``RESULT.rank<N>`` after each configuration, so a later failure keeps them; rank 0 prints
``PROGRESS`` lines for the driver.

A local-steps configuration (commopt's schedule, torchft's ``DiLoCo``) sends on few steps: its
blocks are whole cycles of ``sync_every`` steps (the block rounded up to a multiple of the
cycle, the steps to a multiple of the block), so that every block holds each fragment's
synchronisation as often as the others; its step time is the mean over those cycles
(``commopt.bench.step.configs.step_seconds``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import time
from pathlib import Path

from commopt.bench.step.configs import (
    CONFIGS,
    StepConfig,
    commopt_wire_bytes,
    ddp_wire_bytes,
    powersgd_start_iter,
    step_seconds,
    wrap_commopt,
    wrap_ddp,
)
from commopt.bench.step.floor import codec_seconds
from commopt.bench.step.models import MODELS, param_shapes

#: Lines a worker prints for the driver to pass on (progress); everything else goes to the log.
PROGRESS = "@step_bench "
#: Names a configuration whose last rank raises at start: tests the driver's restart.
FAIL_ENV = "COMMOPT_STEP_BENCH_FAIL"


def run_worker(args: argparse.Namespace) -> int:
    """This rank's part of the job: ``args.worker`` is the comma-separated schedule."""
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
        # --profile: the first time each configuration runs (its first round).
        profile = getattr(args, "profile", False) and name not in schedule[:index]
        rec = _run_config(cfg, spec, comm, gloo, args, profile=profile)
        # The configuration's model, optimizers and closures went with _run_config's frame
        # (a `del` there would also empty the cells its step closures read); collect them
        # before the next one is built.
        gc.collect()
        gloo.allgather_obj(None)  # the next configuration starts on every rank together
        rec.update(index=index, config=name, kind=cfg.kind, rank=comm.rank, size=comm.size)
        records.append(rec)
        out.write_text(json.dumps(records))  # after each one: a later failure keeps these
        if comm.rank == 0:
            print(
                f"{PROGRESS}done {index} {name} "
                f"{step_seconds(cfg, rec['step_times']) or math.nan:.6f} "
                f"{rec['eval_loss']:.6f}",
                flush=True,
            )
    gloo.allgather_obj(None)  # nobody tears down while a peer still reads
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def cycle_blocks(cfg: StepConfig, steps: int, block: int) -> tuple[int, int]:
    """(steps, block) of ``cfg``: unchanged, or for a local-steps configuration the block
    rounded up to whole cycles and the steps up to whole blocks.

        >>> cycle_blocks(CONFIGS["commopt-local-steps16-qsgd4+ef"], 24, 4)
        (32, 16)
        >>> cycle_blocks(CONFIGS["ddp-fp32"], 24, 4)
        (24, 4)
    """
    if not cfg.local_steps:
        return steps, block
    block = -(-block // cfg.cycle) * cfg.cycle
    return -(-steps // block) * block, block


def _run_config(cfg: StepConfig, spec, comm, gloo, args, profile: bool = False) -> dict:
    """Build, warm up, time and tear down one configuration on this rank."""
    import torch
    import torch.nn.functional as F

    rank = comm.rank
    if os.environ.get(FAIL_ENV) == cfg.name and rank == comm.size - 1:
        raise RuntimeError(f"failure injected into {cfg.name} (${FAIL_ENV})")
    batch = args.batch or spec.batch_size
    torch.manual_seed(args.seed)
    model = spec.build()
    shapes = param_shapes(model)
    inner = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
    net, wire_bytes = model, 0
    opt: torch.optim.Optimizer = inner
    commopt_opt = None  # commopt's optimizer, when cfg.kind is "commopt"
    steps = args.steps or spec.steps
    block = min(args.block or spec.block, steps)
    steps, block = cycle_blocks(cfg, steps, block)
    n_blocks = -(-steps // block)
    # Double buffering restarts its pipeline after each pause: one untimed step per block,
    # for every configuration so that all train the same number of steps.
    restarts = n_blocks - 1
    if cfg.kind == "ddp":
        # -warm: PowerSGD's warm-up is a fraction of every step this configuration trains
        start_iter = powersgd_start_iter(cfg, args.warmup + steps + restarts)
        net, wire_bytes = wrap_ddp(model, cfg, start_iter), ddp_wire_bytes(cfg, shapes)
    elif cfg.kind == "commopt":
        opt = commopt_opt = wrap_commopt(inner, comm, model, cfg)
        wire_bytes = commopt_wire_bytes(opt)
    peer = None  # torchft's DiLoCo around the inner optimizer
    if cfg.kind == "torchft":
        from commopt.bench.torchft_peer import TorchftDiLoCo

        peer = TorchftDiLoCo(model, inner, gloo, cfg, args.seed)
        wire_bytes = round(peer.wire_bytes_per_sync / cfg.sync_every)
        peer.__enter__()
    # The compute-only twin: the same model and optimizer, no communication.
    torch.manual_seed(args.seed)
    twin = spec.build()
    twin_opt = torch.optim.SGD(twin.parameters(), lr=spec.lr, momentum=0.9)
    # one to restart, then the same steps without and with the profiler
    profile_steps = (1 + 2 * args.profile_steps) if profile else 0
    batches = [
        spec.batch(step=i, rank=rank, size=batch)
        for i in range(args.warmup + steps + restarts + profile_steps)
    ]
    feed = iter(batches)
    step_times, backward_times, losses, compute_times, block_eff = [], [], [], [], []
    block_cpu = []  # this process's CPU seconds (every thread) per timed step, per block

    def train_step(timed: bool) -> float:
        x, y = next(feed)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        after_backward = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        _record(loss, start, after_backward, end, timed)
        return end - start

    def marked_step() -> float:
        """train_step's work inside the profile's ranges (only the profiled steps open them)."""
        from commopt.bench.profile_step import step_range

        x, y = next(feed)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with step_range("forward"):
            loss = F.cross_entropy(net(x), y)
        with step_range("backward"):
            loss.backward()
        after_backward = time.perf_counter()
        with step_range("apply"):
            opt.step()
        end = time.perf_counter()
        _record(loss, start, after_backward, end, False)
        return end - start

    def _record(loss, start: float, after_backward: float, end: float, timed: bool) -> None:
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
    if commopt_opt is not None:  # compression="auto" has chosen its plan by now
        wire_bytes = commopt_wire_bytes(commopt_opt)
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
        if commopt_opt is not None:
            commopt_opt.flush()  # double buffering: apply the last averaged gradients (untimed)
        # Right after, with nothing in flight: every rank computes alone, all at once.
        gloo.allgather_obj(None)
        twins = [twin_step(j) for j in range(args.compute_steps or count)]
        compute_times += twins
        block_step = step_seconds(cfg, step_times[first:])
        assert block_step is not None, "a block is whole cycles (cycle_blocks)"
        block_eff.append(statistics.median(twins) / block_step)
    if peer is not None:
        peer.__exit__(None, None, None)
        peer.close()
    if commopt_opt is not None:  # (a local-steps part builds its fragments at its first step)
        wire_bytes = commopt_wire_bytes(commopt_opt)
    # The floor's codec time: this configuration's arithmetic on the gradient, every rank at
    # once (the same sharing of the cores as the compute twin), nothing in flight.
    gloo.allgather_obj(None)
    codec_s = codec_seconds(cfg, shapes, comm.size, opt=commopt_opt)
    with (
        torch.no_grad(),
        commopt_opt.true_weights() if cfg.local_steps and commopt_opt else contextlib.nullcontext(),
    ):  # local steps: at the anchor, the weights the ranks agreed on
        ex, ey = spec.eval_batch()
        eval_loss = float(F.cross_entropy(model(ex), ey))
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    prof = None
    if profile:  # after the figures above: the profiler's pauses cannot touch them
        prof = _profile_steps(cfg, args, rank, train_step, marked_step, gloo)
        if commopt_opt is not None:
            commopt_opt.flush()
    if commopt_opt is not None:
        commopt_opt.close()
    return {
        "batch": batch,
        "step_times": step_times,
        "compute_times": compute_times,
        "block_efficiency": block_eff,
        "backward_times": backward_times,
        "losses": losses,
        "cpu_per_step": block_cpu,
        "codec_s": codec_s,
        "profile": prof,
        "eval_loss": eval_loss,
        "checksum": checksum,
        "wire_bytes": wire_bytes,
        "params": sum(math.prod(s) for s in shapes),
        "cycle": cfg.cycle,
    }


def _profile_steps(cfg: StepConfig, args, rank: int, train_step, marked_step, gloo) -> dict:
    """``args.profile_steps`` steps as timed, then as many under ``torch.profiler`` with every
    thread's CPU from its clock; the trace is kept beside the rank's results."""
    import threading

    import torch

    from commopt import profiling
    from commopt.bench.profile_step import attribute, cpu_delta, thread_cpu, trace_events

    train_step(timed=False)  # double buffering: restart the pipeline flushed after the blocks
    gloo.allgather_obj(None)
    # The same steps without the profiler, right before: what profiling them costs.
    plain_cpu = time.process_time()
    plain = [train_step(timed=False) for _ in range(args.profile_steps)]
    plain_cpu = time.process_time() - plain_cpu
    gloo.allgather_obj(None)  # both ranks profiled from here on
    with profiling.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        before, wall, cpu = thread_cpu(), time.perf_counter(), time.process_time()
        times = [marked_step() for _ in range(args.profile_steps)]
        after, wall = thread_cpu(), time.perf_counter() - wall
        cpu = time.process_time() - cpu
    trace = Path(f"{args.result}.{cfg.name}.rank{rank}.trace.json")
    prof.export_chrome_trace(str(trace))
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    threads = attribute(trace_events(trace), cpu_delta(before, after), names)
    return {
        "steps": args.profile_steps,
        "wall_s": wall,
        "step_times": times,
        "plain_step_times": plain,
        "cpu_s": cpu,  # the process's CPU (every thread) over the profiled steps
        "plain_cpu_s": plain_cpu,  # and over the same steps without the profiler
        "trace": trace.name,
        "threads": {str(tid): t for tid, t in threads.items()},
    }
