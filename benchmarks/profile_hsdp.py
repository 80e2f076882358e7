"""Processor time per step of HSDP's reduction between nodes, by part, on every rank.

Runs the speed model of ``commopt bench hsdp`` (the wide MLP, 25.2M parameters, batch 8 per
rank) on a (replicate, shard) mesh of 2 nodes x 2 ranks, each configuration in turn, and
reports each rank's processor time per step (CPU time, not wall time: the numbers hold on a
loaded machine), split by thread and, for commopt's reduction, by part. Each part is the
self time (its own, not its nested parts') of one thread's CPU clock between entering and
leaving it:

- commopt's phases (``commopt.profiling.phase``: pack, encode, transport, wait, decode,
  agree, unpack), with the codec's kernels split out of encode/decode: ``qsgd.encode``,
  ``qsgd.decode``, ``qsgd.check_scales`` (the decode's check of the wire's scales) and
  ``ef.nan_to_num`` (error feedback's reset of non-finite residuals); what stays in
  ``encode`` is error feedback's own arithmetic (residual + gradient);
- ``hook``: the rest of FSDP's all-reduce hook (``CompressedReplicas.reduce_unit``), and
  ``end_backward``: the end of backward (waiting for the reductions, the NaN/Inf agreement);
- ``forward``, ``backward`` (FSDP's all-gathers and reduce-scatters included), ``optimizer``:
  the rest of the main thread; ``other threads``: gloo's and autograd's threads.

    commopt launch -n 4 --launcher torch --ranks-per-host 2 -- \\
        python benchmarks/profile_hsdp.py --configs commopt-qsgd4-ef,hsdp-bf16 --steps 5

Rank 0 prints the table (mean over ranks, ms per step) and writes ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

_local = threading.local()
_totals: dict[str, float] = defaultdict(float)  # part -> CPU seconds (self time)
_lock = threading.Lock()
_OFF_MAIN = "(parts off the main thread)"


@contextlib.contextmanager
def part(name: str):
    """Count this thread's CPU time inside the block as ``name`` (self time: nested parts
    count for themselves)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(0.0)  # CPU time of nested parts
    start = time.thread_time()
    try:
        yield
    finally:
        took = time.thread_time() - start
        nested = stack.pop()
        if stack:
            stack[-1] += took
        with _lock:
            _totals[name] += took - nested
            if threading.current_thread() is not threading.main_thread():
                _totals[_OFF_MAIN] += took - nested


def _wrap(owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        with part(name):
            return fn(*args, **kwargs)

    setattr(owner, attr, wrapped)


def instrument() -> None:
    """Route commopt's phases and the codec's kernels through :func:`part`."""
    import commopt.profiling
    from commopt.codecs import error_feedback, qsgd
    from commopt.integrations import fsdp

    def phase(name: str):
        return part(name)

    original = commopt.profiling.phase
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("commopt") and (
            getattr(mod, "phase", None) is original
        ):
            mod.phase = phase  # type: ignore[attr-defined]
    _wrap(qsgd.QSGD, "encode", "qsgd.encode")
    _wrap(qsgd.QSGD, "decode_scaled", "qsgd.decode")
    qsgd.QSGD.decode = qsgd.QSGD.decode_scaled  # type: ignore[method-assign]
    if "decode_own" in vars(qsgd.QSGD):  # error feedback's read-back of its own wire
        _wrap(qsgd.QSGD, "decode_own", "qsgd.decode")
    _wrap(qsgd.QSGD, "_check_scales", "qsgd.check_scales")
    nan_to_num_ = torch.nan_to_num_

    class _Torch:  # error_feedback's view of torch: nan_to_num_ counted, the rest as is
        def __getattr__(self, attr):
            return getattr(torch, attr)

        @staticmethod
        def nan_to_num_(*args, **kwargs):
            with part("ef.nan_to_num"):
                return nan_to_num_(*args, **kwargs)

    error_feedback.torch = _Torch()  # type: ignore[assignment]
    _wrap(fsdp.CompressedReplicas, "reduce_unit", "hook")
    _wrap(fsdp.CompressedReplicas, "_end_backward", "end_backward")


def shard(model, mesh, config: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from commopt.integrations.fsdp import compress_replicas

    on = mesh if config.startswith("hsdp-") else mesh["shard"]
    kw = {}
    if config == "hsdp-bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=on, **kw)
    fully_shard(model, mesh=on, **kw)
    replicas = None
    if config.startswith("commopt-"):
        codec = config[len("commopt-") :]
        codec = codec[:-3] + "+ef" if codec.endswith("-ef") else codec
        replicas = compress_replicas(model, mesh["replicate"], codec)
    return model, replicas


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="commopt-qsgd4-ef,commopt-fp32,hsdp-fp32,hsdp-bf16")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", help="rank 0 writes the figures here")
    args = ap.parse_args()

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from commopt.bench.step.models import MODELS

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(
        "cpu", (args.nodes, world // args.nodes), mesh_dim_names=("replicate", "shard")
    )
    instrument()
    spec = MODELS["mlp"]
    torch.manual_seed(0)
    results = {}
    for config in args.configs.split(","):
        model, replicas = shard(spec.build(), mesh, config)
        opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
        step = 0
        for measured in (False, True):
            dist.barrier()
            _totals.clear()
            cpu = time.process_time()
            main_cpu = time.thread_time()
            for _ in range(args.steps if measured else args.warmup):
                x, y = spec.batch(step, rank, spec.batch_size)
                step += 1
                opt.zero_grad(set_to_none=True)
                with part("forward"):
                    loss = F.cross_entropy(model(x), y)
                with part("backward"):
                    loss.backward()
                with part("optimizer"):
                    if replicas is not None:
                        replicas.step(opt)
                    else:
                        opt.step()
            total = time.process_time() - cpu
            main_cpu = time.thread_time() - main_cpu
        parts = {k: v / args.steps for k, v in _totals.items()}
        off_main = parts.pop(_OFF_MAIN, 0.0)
        # gloo's and autograd's threads: what no part on a thread other than the main one holds
        parts["other threads"] = (total - main_cpu) / args.steps - off_main
        parts["total"] = total / args.steps
        every = [None] * world
        dist.all_gather_object(every, parts)
        results[config] = {
            k: sum(p.get(k, 0.0) for p in every) / world for k in set().union(*every)
        }
        if replicas is not None:
            replicas.close()
    if rank == 0:
        order = [
            "forward", "backward", "hook", "pack", "encode", "qsgd.encode", "ef.nan_to_num",
            "transport", "wait", "decode", "qsgd.decode", "qsgd.check_scales", "agree", "unpack",
            "end_backward", "optimizer", "other threads", "total",
        ]  # fmt: skip
        configs = list(results)
        print("CPU ms per step and rank (mean of the ranks); self time of each part")
        print(f"{'part':<18}" + "".join(f"{c:>18}" for c in configs))
        for k in order:
            print(f"{k:<18}" + "".join(f"{results[c].get(k, 0.0) * 1e3:>18.1f}" for c in configs))
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "command": f"commopt launch -n {world} --launcher torch --ranks-per-host "
                        f"{world // args.nodes} -- python " + " ".join(sys.argv),
                        "world": world,
                        "nodes": args.nodes,
                        "steps": args.steps,
                        "threads": args.threads,
                        "load_average": os.getloadavg()[0],
                        "cpu_s_per_step": results,
                    },
                    indent=1,
                )
                + "\n"
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
