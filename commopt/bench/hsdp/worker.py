"""One rank of ``commopt bench hsdp``: every configuration in turn, round after round.

The ranks form a (replicate, shard) mesh of ``--nodes`` x ranks per node (ranks 0..k-1 on
the first host). Each configuration shards its own copy of the model:

- ``fsdp-node``: FSDP2 on the node's ranks only, no reduction between nodes (the replicas
  drift apart): everything but the link, the floor of the others;
- ``hsdp-fp32`` / ``hsdp-bf16``: FSDP2's native HSDP on the 2-D mesh, the replicas'
  all-reduce in fp32 / in bf16 (``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``);
- ``commopt-<codec>``: FSDP2 on the node's ranks, ``compress_replicas`` between nodes.

Speed (default): the step benchmark's model (``--model``, default ``mlp``: the wide MLP of
25.2M parameters at batch 8 per rank, communication-bound) and its batches, SGD with
momentum; each round times ``--steps`` steps of every
configuration after ``--warmup`` untimed ones (first round only), every rank at once; a
step's time is the slowest rank's, its processor time the mean over ranks of each rank's
(every thread: autograd, commopt's worker, gloo's). Accuracy (``--accuracy``): a task of ``commopt bench
to_accuracy`` (``--task``: digits, scikit-learn's digits and the wide MLP, or text; Adam), every
configuration from the same weights on the same batches for ``--budget`` steps, then the
validation loss and whether every shard's replicas hold the same weights. Rank 0 writes
``--result``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

#: Lines rank 0 prints for the driver.
PROGRESS = "@hsdp "


def _codec_of(config: str) -> str | None:
    """The codec of a commopt configuration; None for the other kinds.

    >>> _codec_of("commopt-qsgd4-ef"), _codec_of("commopt-bf16"), _codec_of("hsdp-fp32")
    ('qsgd4+ef', 'bf16', None)
    """
    if not config.startswith("commopt-"):
        return None
    name = config[len("commopt-") :]
    return name[:-3] + "+ef" if name.endswith("-ef") else name


def check_configs(configs: list[str]) -> None:
    """Raise SystemExit naming a configuration this benchmark does not know."""
    from commopt.codecs import get_codec

    for c in configs:
        if c in ("fsdp-node", "hsdp-fp32", "hsdp-bf16"):
            continue
        codec = _codec_of(c)
        try:
            if codec is None:
                raise ValueError(c)
            get_codec(codec)
        except (ValueError, KeyError):
            raise SystemExit(
                f"commopt bench hsdp: unknown configuration {c!r}: fsdp-node, hsdp-fp32, "
                "hsdp-bf16 or commopt-<codec> (commopt-fp32, commopt-bf16, commopt-qsgd4-ef, ...)"
            ) from None


def run_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import commopt
    from commopt.comm.torch_dist import init_default_group

    torch.set_num_threads(args.threads)
    commopt.reuse_freed_memory()
    init_default_group("gloo", args.collective_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = world // args.nodes
    node = int(os.environ.get("GROUP_RANK", rank // per_node))
    if world % args.nodes or node != rank // per_node:
        raise SystemExit(
            f"rank {rank}: expected {args.nodes} nodes of {per_node} consecutive ranks "
            f"(this rank says node {node})"
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (args.nodes, per_node), mesh_dim_names=("replicate", "shard"))
    configs = args.configs.split(",")
    if args.accuracy:
        result = _accuracy(args, mesh, configs)
    else:
        result = _speed(args, mesh, configs)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    return 0


def _shard(model, mesh, config: str, seed: int):
    """Shard ``model`` for ``config``: (model, replicas or None)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from commopt.integrations.fsdp import compress_replicas

    native = config.startswith("hsdp-")
    on = mesh if native else mesh["shard"]
    kw: dict[str, Any] = {}
    if config == "hsdp-bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for m in model.modules():  # each Linear a unit (the text task's model is no Sequential)
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=on, **kw)
    fully_shard(model, mesh=on, **kw)
    codec = _codec_of(config)
    replicas = None
    if codec is not None:
        replicas = compress_replicas(model, mesh["replicate"], codec, seed=seed)
    return model, replicas


def _wire_bytes(model, replicas, config: str) -> int:
    """Bytes this rank hands to the reduction between nodes per step."""
    if config == "fsdp-node":
        return 0
    if replicas is not None:
        return replicas.wire_bytes()
    shard = sum(p.to_local().numel() for p in model.parameters())
    return shard * (2 if config == "hsdp-bf16" else 4)


def _step(model, opt, replicas, x, y) -> float:
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if replicas is not None:
        replicas.step(opt)
    else:
        opt.step()
    return float(loss)


def _speed(args, mesh, configs: list[str]) -> dict:
    import torch
    import torch.distributed as dist

    from commopt.bench.step.models import MODELS

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = MODELS[args.model]
    batch = args.batch or spec.batch_size
    torch.manual_seed(args.seed)
    base = spec.build()
    params = sum(p.numel() for p in base.parameters())
    runs = {}
    for config in configs:
        model, replicas = _shard(_copy(base), mesh, config, args.seed)
        opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
        runs[config] = (model, opt, replicas)
    rounds: dict[str, list[float]] = {c: [] for c in configs}
    cpu_rounds: dict[str, list[float]] = {c: [] for c in configs}
    losses: dict[str, float] = {}
    steps = dict.fromkeys(configs, 0)  # each configuration sees the same batches
    for r in range(args.rounds):
        for config in configs:
            model, opt, replicas = runs[config]
            for _ in range(args.warmup if r == 0 else 0):
                _step(model, opt, replicas, *spec.batch(steps[config], rank, batch))
                steps[config] += 1
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                x, y = spec.batch(steps[config], rank, batch)
                losses[config] = _step(model, opt, replicas, x, y)
                steps[config] += 1
            took = torch.tensor([(time.perf_counter() - start) / args.steps])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            rounds[config].append(float(took))
            # every thread of the rank (autograd, commopt's worker, gloo's), mean over ranks
            used = torch.tensor([(time.process_time() - cpu) / args.steps / world])
            dist.all_reduce(used)
            cpu_rounds[config].append(float(used))
            if rank == 0:
                print(
                    f"{PROGRESS}{config} round {r + 1}: {took.item() * 1e3:.0f} ms/step", flush=True
                )
    out = {}
    for config in configs:
        model, _, replicas = runs[config]
        out[config] = {
            "step_s": statistics.median(rounds[config]),
            "rounds_s": rounds[config],
            "rank_cpu_s": statistics.median(cpu_rounds[config]),
            "wire_bytes_per_rank": _wire_bytes(model, replicas, config),
            "final_loss": losses[config],
        }
    return {
        "mode": "speed",
        "model": spec.description,
        "batch": batch,
        "params": params,
        "world": world,
        "configs": out,
    }


def _accuracy(args, mesh, configs: list[str]) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from commopt.bench.to_accuracy_tasks import TASKS

    rank = dist.get_rank()
    task = TASKS[args.task](args)
    vx, vy = task.valid
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for config in configs:
            torch.manual_seed(seed)
            model, replicas = _shard(task.build(), mesh, config, seed)
            opt = torch.optim.Adam(model.parameters(), lr=args.lr)
            gen = torch.Generator().manual_seed(seed * 1000 + rank)
            start = time.perf_counter()
            for _ in range(args.budget):
                x, y = task.batch(gen)
                _step(model, opt, replicas, x, y)
            took = time.perf_counter() - start
            with torch.no_grad():
                logits = model(vx)
                valid = float(F.cross_entropy(logits, vy))
                top1 = float((logits.argmax(-1) == vy).float().mean()) * 100
            model.reshard()  # the root unit keeps its own parameters (text: the embedding) whole
            mine = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
            peers = [torch.empty_like(mine) for _ in range(args.nodes)]
            dist.all_gather(peers, mine, group=mesh["replicate"].get_group())
            same = torch.tensor([float(all(torch.equal(p, peers[0]) for p in peers))])
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            entry = {
                "seed": seed,
                "valid_loss": valid,
                "top1": top1,
                "replicas_equal": bool(same.item() == 1.0),
                "train_s": took,
                "skipped_steps": replicas.skipped_steps if replicas is not None else 0,
            }
            runs[config].append(entry)
            if rank == 0:
                print(
                    f"{PROGRESS}{config} seed {seed}: validation loss {valid:.4f}, top-1 "
                    f"{top1:.2f}% after "
                    f"{args.budget} steps ({took:.0f} s)",
                    flush=True,
                )
    return {
        "mode": "accuracy",
        "task": task.describe(args),
        "batch": args.batch,
        "lr": args.lr,
        "configs": runs,
    }


def _copy(model):
    import copy

    return copy.deepcopy(model)


def link_floor_s(wire_bytes_per_rank: float, ranks_per_node: int, nodes: int, rate_bits):
    """Least time the hosts' links need per step: a bandwidth-optimal allreduce among the
    nodes of every rank's bytes, the node's ranks sharing its link (2(n-1)/n x bytes / rate).

    >>> round(link_floor_s(50e6, 2, 2, 1e9), 3)  # 2 ranks x 50 MB per host, 2 hosts, 1 Gbit/s
    0.8
    """
    if rate_bits is None or nodes < 2:
        return None
    return 2 * (nodes - 1) / nodes * wire_bytes_per_rank * ranks_per_node * 8 / rate_bits
