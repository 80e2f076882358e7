"""One rank of a time-to-accuracy job: every (seed, configuration) of its schedule in turn.

For each seed, DDP fp32 runs first for ``--budget`` steps: its validation loss at the budget,
raised by ``--tolerance``, is that seed's target. Every other configuration then starts from
the same weights and sees the same batches (same seed), trains with Adam and evaluates the
validation loss every ``--eval-every`` steps; it stops at the first evaluation at or below
the target, or after ``--budget-factor`` x the budget. The training clock stops during
evaluation (every rank evaluates, then all restart together), so the curve's wall time is
training time only. Compensated double buffering is evaluated at its true weights
(``opt.true_weights()``); plain double buffering as training left them (one step behind);
the local-steps configurations at the anchor (``opt.true_weights()``, the weights every rank
agreed on at the last synchronisation; torchft's ``DiLoCo``: rank 0's weights, which between
its synchronisations are local). Beside each evaluation the record keeps the bytes sent so far
(``sent_bytes``): a reduction's bytes on every step for DDP and the per-step schedules, a
fragment's outer gradients on the steps it sends them for local steps, nothing on the others.

After each configuration, every rank at once: ``--compute-steps`` steps of a compute-only
twin (the same model and Adam, no communication; priced as the training steps are, at the
median of the repeats' medians) and the configuration's codec arithmetic
on one step's gradient (``commopt.bench.step.floor.codec_seconds``): the floor's time per
step. A configuration whose wrapper cannot be built (the same error on every rank, such as
an unknown codec) is recorded with its error and the job goes on. Rank 0 writes ``RESULT``
after each configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from commopt.bench.step.configs import (
    COMPENSATED,
    CONFIGS,
    commopt_sent_bytes,
    commopt_wire_bytes,
    ddp_wire_bytes,
    powersgd_start_iter,
    wrap_commopt,
    wrap_ddp,
)

#: Lines rank 0 prints for the driver (progress).
PROGRESS = "@to_accuracy "
REFERENCE = "ddp-fp32"


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def run_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import commopt
    from commopt.bench.to_accuracy_tasks import TASKS

    torch.set_num_threads(args.threads)
    comm = commopt.create_communicator("torch", timeout_s=args.collective_timeout)
    task = TASKS[args.task](args)
    names = args.worker.split(",")
    seeds = [int(s) for s in str(args.seeds).split(",")]
    records: list[dict] = []
    for seed in seeds:
        target = None
        for name in names:
            if comm.rank == 0:
                print(f"{PROGRESS}start {name} seed {seed}", flush=True)
            rec = _train(CONFIGS[name], comm, args, task, seed, target)
            gc.collect()
            comm.allgather_obj(None)
            rec.update(config=name, seed=seed)
            records.append(rec)
            if name == REFERENCE and "curve" in rec:
                target = rec["curve"][-1][2] * (1 + args.tolerance)
            if comm.rank == 0:
                Path(args.result).write_text(json.dumps(records))
                if "curve" in rec:
                    step, wall, loss = rec["curve"][-1]
                    done = f"{wall:.1f} s, {step} steps, loss {loss:.4f} ({rec['stopped']})"
                else:
                    done = f"failed: {rec['error']}"
                print(f"{PROGRESS}done {name} seed {seed}: {done}", flush=True)
                if name == REFERENCE and "curve" in rec:
                    print(f"{PROGRESS}{_ratio_line(rec, args)}", flush=True)
    comm.allgather_obj(None)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _ratio_line(rec: dict, args) -> str:
    """DDP fp32's median step against its compute-only step, checked against the setting."""
    from commopt.bench.to_accuracy_report import SETTING_MIN_RATIO, step_ratio_text

    return step_ratio_text(
        statistics.median(rec["step_times"]),
        rec["compute_s"],
        SETTING_MIN_RATIO.get(getattr(args, "setting", None)),
    )


def _train(cfg, comm, args, task, seed: int, target: float | None) -> dict:
    import torch
    import torch.nn.functional as F

    from commopt.bench.step.floor import codec_seconds

    is_reference = cfg.name == REFERENCE
    budget = args.budget
    if not is_reference and target is not None:
        budget = int(args.budget * args.budget_factor)
    torch.manual_seed(seed)
    model = task.build()
    shapes = [tuple(p.shape) for p in model.parameters()]
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)
    net = model
    opt: torch.optim.Optimizer = inner
    commopt_opt: Any = None  # commopt's optimizer (wrapping Adam): flush(), true_weights()
    extra: dict[str, Any] = {}
    error = None
    peer: Any = None  # torchft's DiLoCo (a context manager) and what it needs
    try:
        if cfg.kind == "torchft":
            from commopt.bench.torchft_peer import TorchftDiLoCo

            peer = TorchftDiLoCo(model, inner, comm, cfg, seed, outer_lr=args.outer_lr)
            wire = peer.wire_bytes_per_sync // cfg.sync_every
        elif cfg.kind == "ddp":
            start_iter = powersgd_start_iter(cfg, args.budget, args.powersgd_warmup)
            net, wire = wrap_ddp(model, cfg, start_iter), ddp_wire_bytes(cfg, shapes)
            if cfg.wire == "powersgd":
                extra["powersgd_start_iter"] = start_iter
        else:
            opt = commopt_opt = wrap_commopt(inner, comm, model, cfg, args.outer_lr)
            wire = commopt_wire_bytes(opt)
            extra["plans"] = list(commopt_opt.plans)
    except Exception as exc:  # the same on every rank: recorded, and the job goes on
        error = f"{type(exc).__name__}: {exc}"
    errors = comm.allgather_obj(error)
    if any(errors):
        return {"error": next(e for e in errors if e)}
    gen = torch.Generator().manual_seed(seed * 1000 + comm.rank)
    vx, vy = task.valid

    def evaluate() -> float:
        with torch.no_grad():
            if cfg.double_buffering == COMPENSATED or (cfg.local_steps and commopt_opt):
                with commopt_opt.true_weights():
                    return float(F.cross_entropy(model(vx), vy))
            return float(F.cross_entropy(model(vx), vy))

    curve = [(0, 0.0, evaluate())]  # (step, training wall seconds, validation loss)
    step_times = []
    sent_live: list[int] = []  # commopt: bytes sent by each step
    stopped = "budget"
    comm.allgather_obj(None)
    with peer if peer is not None else contextlib.nullcontext():
        for step in range(1, budget + 1):
            x, y = task.batch(gen)
            # compression="auto"'s measured steps send what its measuring part sends (exact
            # reductions, or nothing on the local-steps cycle), counted before the plan comes
            measuring = cfg.wire == "auto" and commopt_opt is not None and not commopt_opt.auto_plan
            exact = commopt_sent_bytes(commopt_opt) if measuring else 0
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
            step_times.append(time.perf_counter() - start)
            if commopt_opt is not None:  # what this step sent, by the plan it ran under
                sent_live.append(exact if measuring else commopt_sent_bytes(commopt_opt))
            if step % args.eval_every == 0 or step == budget:
                # Plain double buffering's weights lag one step: evaluated as training left them.
                loss = evaluate()
                # Rank 0's loss decides for every rank (every rank restarts the clock together).
                loss = comm.allgather_obj(loss)[0]
                curve.append((step, sum(step_times), loss))
                if not is_reference and target is not None and loss <= target:
                    stopped = "target"
                    break
    # The floor's time per step, every rank at once, nothing in flight.
    comm.allgather_obj(None)
    codec_s = codec_seconds(cfg, shapes, comm.size, opt=commopt_opt)
    steps_run = curve[-1][0]
    if commopt_opt is not None:
        per_step = sent_live[:steps_run]
    elif peer is not None:
        per_step = [
            peer.wire_bytes_per_sync if t % cfg.sync_every == 0 else 0
            for t in range(1, steps_run + 1)
        ]
    else:
        per_step = [wire] * steps_run
    sent = [0]  # bytes sent by the end of each step (0: before the first)
    for b in per_step:
        sent.append(sent[-1] + b)
    extra["sent_bytes"] = [sent[point[0]] for point in curve]
    if peer is not None:
        peer.close()
    if commopt_opt is not None:
        wire = commopt_wire_bytes(commopt_opt)  # compression="auto" has chosen its plan by now
        extra["plans"] = list(commopt_opt.plans)
        if commopt_opt.auto_plan is not None:  # the per-tensor choices and their inputs
            extra["auto_plan"] = json.loads(commopt_opt.auto_plan.to_json())
        commopt_opt.flush()
        commopt_opt.close()
    compute_s, compute_repeats = _compute_seconds(task, seed, args, comm)
    return {
        "curve": curve,
        "step_times": step_times,
        "stopped": stopped,
        "stop_target": None if is_reference else target,
        "compute_s": compute_s,
        "compute_repeats": compute_repeats,
        "codec_s": codec_s,
        "wire_bytes": wire,
        "params": sum(math.prod(s) for s in shapes),
        **extra,
    }


def _compute_seconds(task, seed: int, args, comm) -> tuple[float, list[float]]:
    """A compute-only twin's step (the same model and Adam, no communication), measured as the
    training steps are: the median of REPEATS repeats (consecutive blocks, each at its median;
    the first step is warm-up), and the repeats themselves (for the report's outliers)."""
    import torch
    import torch.nn.functional as F

    from commopt.bench.to_accuracy_report import step_repeats

    torch.manual_seed(seed)
    twin = task.build()
    twin_opt = torch.optim.Adam(twin.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(seed * 1000 + comm.rank + 500)
    batches = [task.batch(gen) for _ in range(args.compute_steps + 1)]
    times = []
    comm.allgather_obj(None)  # every rank computes at once: the cores shared as in training
    for x, y in batches:
        start = time.perf_counter()
        twin_opt.zero_grad(set_to_none=True)
        F.cross_entropy(twin(x), y).backward()
        twin_opt.step()
        times.append(time.perf_counter() - start)
    rep = step_repeats(times[1:], len(times) - 1)
    return rep["median_step_s"], rep["repeats"]
