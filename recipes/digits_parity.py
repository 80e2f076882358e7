"""Accuracy parity on real data: does compressed communication keep fp32's accuracy?

A small CNN learns scikit-learn's ``load_digits`` (1797 real 8x8 hand-written digits, shipped
with the package) data-parallel on the ranks of this job, once per communication
configuration and seed, with identical data order and initialisation. The benchmark claim:
the mean final test accuracy of fp16, qsgd4, qsgd4+ef and double buffering stays within
1 point of fp32's (mean of 3 seeds).

    mpirun --allow-run-as-root -np 2 python -m recipes.digits_parity --out parity.json
    commopt launch -n 2 -- python -m recipes.digits_parity --configs fp32,qsgd4 --seeds 0

Configurations: ``fp32`` (plain), ``fp16`` (allreduce_grad_dtype float16, ChainerMN's FP16
allreduce), ``qsgd4``, ``qsgd4+ef`` (error feedback), ``db`` (fp32 with double buffering)
and ``qsgd4+ef+db``; any ``CODEC[+db]`` with a codec name works too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from commopt.tables import table
from recipes.common import RecipeError, create_communicator, state_digest
from recipes.digits_data import load_digits_split
from recipes.resnet50.data import EpochBatches

DEFAULT_CONFIGS = ("fp32", "fp16", "qsgd4", "qsgd4+ef", "db")
TOLERANCE_POINTS = 1.0


def small_cnn() -> nn.Module:
    """Two 3x3 convolutions and two linear layers: about 38k parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def parse_config(label: str) -> dict:
    """``fp32``, ``fp16``, ``db``, ``CODEC`` or ``CODEC+db`` -> optimizer-wrapper options."""
    name = label.strip().lower()
    double_buffering = name == "db" or name.endswith("+db")
    base = "fp32" if name == "db" else (name[:-3] if name.endswith("+db") else name)
    if base in ("fp32", "none", ""):
        return dict(
            label=label,
            compression=None,
            allreduce_grad_dtype=None,
            double_buffering=double_buffering,
        )
    if base in ("fp16", "float16"):
        return dict(
            label=label,
            compression=None,
            allreduce_grad_dtype="float16",
            double_buffering=double_buffering,
        )
    from commopt.codecs.registry import get_codec

    try:
        get_codec(base)
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"configuration {label!r}: {exc}") from None
    return dict(
        label=label, compression=base, allreduce_grad_dtype=None, double_buffering=double_buffering
    )


def compressed_fraction(model: nn.Module) -> float:
    """Share of the gradient elements the default per-layer policy compresses."""
    from commopt.codecs import CompressionPolicy

    policy = CompressionPolicy()
    total = sum(p.numel() for p in model.parameters())
    comp = sum(
        p.numel() for n, p in model.named_parameters() if policy.should_compress(n, tuple(p.shape))
    )
    return comp / total


def train_once(
    comm, data, config: dict, seed: int, *, epochs: int, global_batch: int, lr: float
) -> dict:
    """One data-parallel training run; every rank returns the same result."""
    import commopt

    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    model = small_cnn()
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    opt = commopt.create_multi_node_optimizer(
        inner,
        comm,
        double_buffering=config["double_buffering"],
        allreduce_grad_dtype=config["allreduce_grad_dtype"],
        compression=config["compression"],
        model=model,
        seed=seed,
    )
    steps_per_epoch = len(y_train) // global_batch
    start = time.perf_counter()
    for epoch in range(epochs):
        # x0.1 for the last third: a simple schedule that ends converged
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 if epoch >= (2 * epochs) // 3 else 1.0)
        for idx in EpochBatches(len(y_train), global_batch, comm.rank, comm.size, seed, epoch):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
    opt.flush()
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    digests = comm.allgather_obj(state_digest(model))
    if len(set(digests)) != 1:
        raise RuntimeError(
            f"{config['label']} seed {seed}: the ranks' models differ after training "
            f"({digests}); the optimizer wrapper must keep replicas identical"
        )
    return {
        "config": config["label"],
        "seed": seed,
        "accuracy": accuracy,
        "digest": digests[0],
        "steps": epochs * steps_per_epoch,
        "seconds": round(elapsed, 2),
        "compressed_fraction": round(compressed_fraction(model), 4)
        if config["compression"]
        else 0.0,
    }


def summarize(runs: list[dict], configs: list[str], tolerance: float = TOLERANCE_POINTS) -> dict:
    """Mean accuracy per configuration and its distance from fp32's, in points."""
    by = {c: [r["accuracy"] for r in runs if r["config"] == c] for c in configs}
    means = {c: sum(v) / len(v) for c, v in by.items() if v}
    base = means.get("fp32")
    rows = []
    for c in configs:
        if c not in means:
            continue
        delta = None if base is None else 100.0 * (means[c] - base)
        rows.append(
            {
                "config": c,
                "mean_accuracy": means[c],
                "accuracies": by[c],
                "delta_points": delta,
                "within_tolerance": None if delta is None else abs(delta) <= tolerance,
            }
        )
    return {
        "tolerance_points": tolerance,
        "rows": rows,
        "all_within": all(r["within_tolerance"] in (True, None) for r in rows),
    }


def markdown(summary: dict, world_size: int, seeds: list[int], epochs: int) -> str:
    head = [
        "configuration",
        "mean top-1 (%)",
        f"seeds {', '.join(map(str, seeds))} (%)",
        "vs fp32 (points)",
        f"within {summary['tolerance_points']:g} point",
    ]
    body = []
    for r in summary["rows"]:
        per = " / ".join(f"{100 * a:.2f}" for a in r["accuracies"])
        delta = "-" if r["delta_points"] is None else f"{r['delta_points']:+.2f}"
        ok = "-" if r["within_tolerance"] is None else ("yes" if r["within_tolerance"] else "NO")
        body.append([r["config"], f"{100 * r['mean_accuracy']:.2f}", per, delta, ok])
    return (
        table(head, body, markdown=True, align="l" * len(head))
        + f"\n\n{world_size} ranks, {epochs} epochs, load_digits test split of 360 images."
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.digits_parity", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="comma-separated configurations (fp32 first is the baseline)",
    )
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--tolerance", type=float, default=TOLERANCE_POINTS, help="points from fp32")
    p.add_argument("--communicator", default="auto")
    p.add_argument("--out", metavar="FILE", help="rank 0 writes the results as JSON here")
    p.add_argument(
        "--check", action="store_true", help="exit 1 unless every config is within tolerance"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        parsed = [parse_config(c) for c in configs]
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        if not configs or not seeds:
            raise RecipeError("give at least one configuration and one seed")
        if args.epochs <= 0 or args.batch_size <= 0:
            raise RecipeError("--epochs and --batch-size must be > 0")
        torch.set_num_threads(1)  # ranks share the cores
        comm = create_communicator(args.communicator)
        if args.batch_size % comm.size:
            raise RecipeError(
                f"--batch-size {args.batch_size} must be divisible by the {comm.size} ranks"
            )
    except (RecipeError, ValueError) as exc:
        print(f"digits_parity: error: {exc}", file=sys.stderr)
        return 2
    data = load_digits_split()
    runs = []
    for config in parsed:
        for seed in seeds:
            result = train_once(
                comm,
                data,
                config,
                seed,
                epochs=args.epochs,
                global_batch=args.batch_size,
                lr=args.lr,
            )
            runs.append(result)
            if comm.rank == 0:
                print(json.dumps(result), flush=True)
    summary = summarize(runs, configs, args.tolerance)
    if comm.rank == 0:
        report = {
            "world_size": comm.size,
            "epochs": args.epochs,
            "global_batch": args.batch_size,
            "lr": args.lr,
            "seeds": seeds,
            "runs": runs,
            **summary,
        }
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        print(markdown(summary, comm.size, seeds, args.epochs))
    if args.check and not summary["all_within"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
