"""One rank of a time-to-accuracy job: every configuration of its schedule, one after another.

Each configuration starts from the same weights and sees the same batches (same seed), trains
``--budget`` steps of the wide character MLP (recipes.text_lm.wide) on Python's help topics
with Adam, and evaluates the validation loss every ``--eval-every`` steps. The training clock
stops during evaluation (every rank evaluates, then all restart together), so the curve's wall
time is training time only. Rank 0 writes ``RESULT`` after each configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path
from typing import Any

from commopt.bench.step.configs import (
    CONFIGS,
    commopt_wire_bytes,
    ddp_wire_bytes,
    wrap_commopt,
    wrap_ddp,
)

#: Lines rank 0 prints for the driver (progress).
PROGRESS = "@to_accuracy "


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def run_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import commopt

    torch.set_num_threads(args.threads)
    comm = commopt.create_communicator("torch", timeout_s=args.collective_timeout)
    records = []
    for name in args.worker.split(","):
        if comm.rank == 0:
            print(f"{PROGRESS}start {name}", flush=True)
        rec = _train(CONFIGS[name], comm, args)
        gc.collect()
        comm.allgather_obj(None)
        rec["config"] = name
        records.append(rec)
        if comm.rank == 0:
            Path(args.result).write_text(json.dumps(records))
            print(
                f"{PROGRESS}done {name} {rec['curve'][-1][1]:.1f} {rec['curve'][-1][2]:.4f}",
                flush=True,
            )
    comm.allgather_obj(None)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _train(cfg, comm, args) -> dict:
    import torch
    import torch.nn.functional as F

    from recipes.text_lm.data import char_corpus
    from recipes.text_lm.wide import WideCharMLP, next_char_batch, next_char_valid

    corpus = char_corpus()
    torch.manual_seed(args.seed)
    model = WideCharMLP(corpus.vocab_size, context=args.context, hidden=args.hidden)
    shapes = [tuple(p.shape) for p in model.parameters()]
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)
    net = model
    opt: torch.optim.Optimizer = inner
    opt_any: Any = opt  # commopt's optimizer (wrapping Adam) has flush() and close()
    if cfg.kind == "ddp":
        net, wire = wrap_ddp(model, cfg), ddp_wire_bytes(cfg, shapes)
    else:
        opt = opt_any = wrap_commopt(inner, comm, model, cfg)
        wire = commopt_wire_bytes(opt)
    gen = torch.Generator().manual_seed(args.seed * 1000 + comm.rank)
    vx, vy = next_char_valid(corpus.valid, args.context, args.valid_windows)

    def evaluate() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(vx), vy))

    curve = [(0, 0.0, evaluate())]  # (step, training wall seconds, validation loss)
    step_times = []
    comm.allgather_obj(None)
    for step in range(1, args.budget + 1):
        x, y = next_char_batch(corpus.train, args.batch, args.context, gen)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        step_times.append(time.perf_counter() - start)
        if step % args.eval_every == 0 or step == args.budget:
            # Double buffering's weights lag one step: evaluated as training left them.
            curve.append((step, sum(step_times), evaluate()))
            comm.allgather_obj(None)  # every rank restarts the clock together
    if cfg.kind == "commopt":
        opt_any.flush()
        opt_any.close()
    return {
        "curve": curve,
        "step_times": step_times,
        "wire_bytes": wire,
        "params": sum(math.prod(s) for s in shapes),
    }
