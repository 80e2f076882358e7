"""Train ResNet-50 data-parallel with commopt: ImageNet from a folder, or synthetic images.

One runnable script, top to bottom as the PyTorch examples it mirrors (arguments, data, model,
loop, evaluation, checkpoints); what both recipes share lives in recipes/common.py,
recipes/run_log.py and recipes/precision.py.

    python -m recipes.resnet50.train --preset smoke                      # one process, CPU
    mpirun -np 2 python -m recipes.resnet50.train --preset smoke --compression qsgd4
    torchrun --nproc-per-node 8 -m recipes.resnet50.train --preset imagenet-32gpu --data /imagenet
    srun -N 4 --ntasks-per-node 8 python -m recipes.resnet50.train --preset imagenet-lars-32k \\
        --data /imagenet --communicator pure_nccl --allreduce-grad-dtype float16 --double-buffering

``--batch-size`` is the global batch (all ranks together). SGD follows ChainerMN's schedule
(warm-up, then x0.2 at epoch 30, x0.1 at 60 and 80); LARS follows MLPerf (poly decay, warm-up
and base LR chosen by the global batch, label smoothing 0.1). Checkpoints hold every rank's
state (double-buffer gradients and error-feedback residuals included) and ``--resume``
continues bit-exactly. Rank 0 shows progress and, with ``--log-jsonl``, writes one JSON
record a line: ``train`` (loss, top1, images_per_s, lr), ``eval``, ``checkpoint``, ``done``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from commopt.optim.checkpoint import join_rank_state, split_rank_state
from commopt.optim.layerwise import LARS
from commopt.optim.lr_schedules import mlperf_lars_defaults, poly_warmup_lr, step_warmup_lr
from recipes.common import (
    RecipeError,
    add_commopt_arguments,
    atomic_save,
    check_commopt_arguments,
    choose_device,
    config_label,
    create_communicator,
    launch_info,
    multi_node_optimizer,
    state_digest,
)
from recipes.precision import PRECISIONS, MixedPrecision
from recipes.resnet50.data import (
    DataError,
    EpochBatches,
    data_source,
    eval_shard,
    make_datasets,
    make_loader,
)
from recipes.resnet50.model import model_source, resnet50
from recipes.resnet50.presets import PRESETS, get_preset
from recipes.run_log import PROGRESS_MODES, RunLog

PROG = "python -m recipes.resnet50.train"
CHECKPOINT_FORMAT = "commopt-resnet50/1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets: " + "; ".join(f"{n}: {pr.description}" for n, pr in PRESETS.items()),
    )
    p.add_argument(
        "--preset",
        default="smoke",
        metavar="NAME",
        help=f"starting settings: {', '.join(PRESETS)} (default smoke)",
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--data", metavar="DIR", help="ImageNet folder with train/ and val/ in ImageFolder layout"
    )
    d.add_argument("--synthetic", action="store_true", help="synthetic images instead of --data")
    d.add_argument(
        "--fake-data",
        action="store_true",
        help="torchvision's FakeData instead of --data (random labels: for speed, it "
        "does not learn); the synthetic images when torchvision does not import",
    )
    d.add_argument("--image-size", type=int, help="crop size (224 for ImageNet)")
    d.add_argument("--num-classes", type=int, help="classes of the synthetic data")
    d.add_argument("--train-size", type=int, help="synthetic training images")
    d.add_argument("--val-size", type=int, help="synthetic validation images")
    d.add_argument("--workers", type=int, help="data-loading processes per rank")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int)
    t.add_argument("--batch-size", type=int, help="global batch: images per step over all ranks")
    t.add_argument("--optimizer", choices=("sgd", "lars"))
    t.add_argument(
        "--lr",
        type=float,
        help="base LR (default: 0.1 per 256 images for sgd, the MLPerf table for lars)",
    )
    t.add_argument("--momentum", type=float)
    t.add_argument("--weight-decay", type=float)
    t.add_argument("--warmup-epochs", type=float)
    t.add_argument("--label-smoothing", type=float)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this many steps in all (the schedule still spans --epochs; 0: no limit)",
    )
    t.add_argument(
        "--amp",
        choices=PRECISIONS,
        default="auto",
        help="mixed precision: fp16 (autocast + GradScaler, CUDA) or bf16 (autocast, "
        "CUDA or CPU); on: fp16 on CUDA, bf16 on the CPU; auto: fp16 with CUDA, "
        "else fp32",
    )
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    t.add_argument("--threads", type=int, help="torch CPU threads per rank")
    e = p.add_argument_group("evaluation, checkpoints and logs")
    e.add_argument(
        "--eval-every", type=int, default=1, help="evaluate every N epochs (and at the end)"
    )
    e.add_argument(
        "--eval-every-steps",
        type=int,
        default=0,
        metavar="N",
        help="also evaluate every N steps (for time-to-accuracy curves)",
    )
    e.add_argument("--no-eval", action="store_true", help="skip evaluation")
    e.add_argument("--checkpoint-dir", metavar="DIR")
    e.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="STEPS",
        help="also checkpoint every N steps (always at each epoch end and at the stop)",
    )
    e.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="STEP",
        help="continue from the latest checkpoint in --checkpoint-dir, or from the "
        "one named (e.g. step-00000100)",
    )
    e.add_argument("--log-jsonl", metavar="FILE", help="rank 0 appends JSON records here")
    e.add_argument("--log-every", type=int, help="steps between train records")
    e.add_argument("--progress", choices=PROGRESS_MODES, default="auto")
    add_commopt_arguments(p)
    return p


@dataclass
class Config:
    preset: str
    data_kind: str
    data_dir: str | None
    image_size: int
    num_classes: int
    train_size: int
    val_size: int
    workers: int
    epochs: int
    global_batch: int
    batch_schedule: list
    optimizer: str
    lr: float
    momentum: float
    weight_decay: float
    warmup_epochs: float
    milestones: list
    label_smoothing: float
    zero_init_residual: bool
    seed: int
    max_steps: int
    log_every: int
    comm: dict = field(default_factory=dict)

    def batch_at(self, epoch: int) -> int:
        batch = self.global_batch
        for at, b in self.batch_schedule:
            if epoch >= at:
                batch = b
        return batch

    def lr_at(self, progress: float) -> float:
        """The LR at a fractional epoch."""
        if self.optimizer == "lars":
            return poly_warmup_lr(
                min(progress, self.epochs),
                base_lr=self.lr,
                total_steps=self.epochs,
                warmup_steps=min(self.warmup_epochs, self.epochs),
                power=2.0,
                end_lr=1e-4,
            )
        return step_warmup_lr(
            progress,
            base_lr=self.lr,
            warmup_epochs=self.warmup_epochs,
            milestones=tuple(tuple(m) for m in self.milestones),
        )

    def fingerprint(self) -> dict:
        """What a resumed run must share with the checkpoint's run."""
        keep = (
            "preset",
            "data_kind",
            "image_size",
            "num_classes",
            "train_size",
            "epochs",
            "global_batch",
            "batch_schedule",
            "optimizer",
            "lr",
            "momentum",
            "weight_decay",
            "warmup_epochs",
            "label_smoothing",
            "seed",
            "comm",
        )
        d = asdict(self)
        return {k: d[k] for k in keep}


def resolve(args: argparse.Namespace) -> Config:
    """Preset + overrides -> Config, or RecipeError/DataError saying what to fix."""
    try:
        preset = get_preset(args.preset)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    if sum(map(bool, (args.synthetic, args.fake_data, args.data))) > 1:
        raise RecipeError("give either --data DIR or --synthetic (or --fake-data), not two of them")
    kind = (
        "synthetic"
        if args.synthetic or (preset.data == "synthetic" and not args.data)
        else "folder"
    )
    kind = "fake" if args.fake_data else kind
    if kind == "folder":
        if not args.data:
            raise DataError(
                f"preset {preset.name} reads ImageNet from a folder: give --data DIR "
                "(train/ and val/ in ImageFolder layout) or add --synthetic"
            )
        root = Path(args.data)
        if not root.is_dir():
            raise DataError(
                f"--data {args.data}: folder not found. Give a folder with "
                "train/<class>/*.JPEG and val/<class>/*.JPEG (ImageFolder layout), "
                "or use --synthetic"
            )
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise DataError(
                    f"--data {args.data}: no {split}/ sub-folder; expected "
                    f"{args.data}/train/<class>/*.JPEG and {args.data}/val/<class>/*.JPEG"
                )

    def pick(value, default):
        return default if value is None else value

    batch = pick(args.batch_size, preset.global_batch)
    schedule = [list(x) for x in preset.batch_schedule]
    if args.batch_size is not None and args.batch_size != preset.global_batch:
        # Keep the preset's batch changes in proportion to the new batch.
        schedule = [[at, max(1, b * args.batch_size // preset.global_batch)] for at, b in schedule]
    optimizer = pick(args.optimizer, preset.optimizer)
    lars_defaults = mlperf_lars_defaults(max(1, batch))
    if optimizer == "lars":
        lr = pick(args.lr, pick(preset.lr, lars_defaults.base_lr))
        wd = pick(args.weight_decay, pick(preset.weight_decay, lars_defaults.weight_decay))
        warmup = pick(args.warmup_epochs, pick(preset.warmup_epochs, lars_defaults.warmup_epochs))
        smoothing = pick(
            args.label_smoothing, pick(preset.label_smoothing, lars_defaults.label_smoothing)
        )
    else:  # Goyal et al.'s linear scaling rule, which ChainerMN's runs followed
        lr = pick(args.lr, pick(preset.lr, 0.1 * batch / 256))
        wd = pick(args.weight_decay, pick(preset.weight_decay, 1e-4))
        warmup = pick(args.warmup_epochs, pick(preset.warmup_epochs, 5.0))
        smoothing = pick(args.label_smoothing, pick(preset.label_smoothing, 0.0))
    cfg = Config(
        preset=preset.name,
        data_kind=kind,
        data_dir=args.data,
        image_size=pick(args.image_size, preset.image_size),
        num_classes=pick(args.num_classes, preset.num_classes),
        train_size=pick(args.train_size, preset.synthetic_train_size),
        val_size=pick(args.val_size, preset.synthetic_val_size),
        workers=pick(args.workers, preset.workers),
        epochs=pick(args.epochs, preset.epochs),
        global_batch=batch,
        batch_schedule=schedule,
        optimizer=optimizer,
        lr=lr,
        momentum=pick(args.momentum, preset.momentum),
        weight_decay=wd,
        warmup_epochs=warmup,
        milestones=[list(m) for m in preset.milestones],
        label_smoothing=smoothing,
        zero_init_residual=preset.zero_init_residual,
        seed=args.seed,
        max_steps=args.max_steps,
        log_every=pick(args.log_every, preset.log_every),
        comm=dict(
            communicator=args.communicator,
            allreduce_grad_dtype=args.allreduce_grad_dtype,
            compression=args.compression,
            double_buffering=args.double_buffering,
            overlap=not args.no_overlap,
        ),
    )
    checks = [
        (cfg.global_batch > 0, f"--batch-size must be > 0, got {cfg.global_batch}"),
        (cfg.epochs > 0, f"--epochs must be > 0, got {cfg.epochs}"),
        (
            cfg.image_size >= 32,
            f"--image-size must be >= 32 (ResNet-50 downsamples 32x), got {cfg.image_size}",
        ),
        (cfg.num_classes >= 2, f"--num-classes must be >= 2, got {cfg.num_classes}"),
        (cfg.lr >= 0, f"--lr must be >= 0, got {cfg.lr}"),
        (cfg.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.weight_decay}"),
        (cfg.warmup_epochs >= 0, f"--warmup-epochs must be >= 0, got {cfg.warmup_epochs}"),
        (
            0 <= cfg.label_smoothing < 1,
            f"--label-smoothing must be in [0, 1), got {cfg.label_smoothing}",
        ),
        (cfg.workers >= 0, f"--workers must be >= 0, got {cfg.workers}"),
        (cfg.max_steps >= 0, f"--max-steps must be >= 0, got {cfg.max_steps}"),
        (cfg.log_every > 0, f"--log-every must be > 0, got {cfg.log_every}"),
        (
            args.checkpoint_every >= 0,
            f"--checkpoint-every must be >= 0, got {args.checkpoint_every}",
        ),
        (args.eval_every >= 0, f"--eval-every must be >= 0, got {args.eval_every}"),
        (
            args.eval_every_steps >= 0,
            f"--eval-every-steps must be >= 0, got {args.eval_every_steps}",
        ),
        (not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir DIR"),
    ]
    if kind in ("synthetic", "fake"):
        checks += [
            (
                cfg.train_size > 0 and cfg.val_size > 0,
                "--train-size and --val-size must be > 0 for synthetic data",
            )
        ]
    for ok, message in checks:
        if not ok:
            raise RecipeError(message)
    check_commopt_arguments(args)
    return cfg


def check_world(cfg: Config, world_size: int) -> None:
    """Every global batch must split evenly over the ranks."""
    for epoch_from, batch in [(0, cfg.global_batch)] + [tuple(x) for x in cfg.batch_schedule]:
        if batch % world_size:
            lo, hi = (batch // world_size) * world_size, (batch // world_size + 1) * world_size
            when = "" if epoch_from == 0 else f" (the preset's batch from epoch {epoch_from})"
            raise RecipeError(
                f"--batch-size {batch}{when} is the global batch and must be divisible by the "
                f"number of ranks ({world_size}): use {lo or hi} or {hi}"
            )
    if cfg.data_kind != "folder" and cfg.train_size < max(
        b for _, b in [(0, cfg.global_batch)] + [tuple(x) for x in cfg.batch_schedule]
    ):
        raise RecipeError(
            f"--train-size {cfg.train_size} is smaller than one global batch "
            f"({cfg.global_batch}): raise --train-size or lower --batch-size"
        )


# --------------------------------------------------------------------------------------------
# checkpoints: the replicated state once (rank 0 writes it), each rank's own state beside it.
# Parameters, the inner optimizer's state and the pending double-buffered gradients are the
# same on every rank. What differs per rank (error-feedback residuals, BN running statistics,
# RNG states) goes into small per-rank files.
# The folder must be visible to every rank (a shared file system on a cluster).


def save_checkpoint(directory: Path, comm, position: dict, model, opt, scaler, cfg: Config) -> Path:
    step_dir = directory / f"step-{position['global_step']:08d}"
    optimizer_state, optimizer_own = split_rank_state(opt.state_dict())  # no communication
    if comm.rank == 0:
        step_dir.mkdir(parents=True, exist_ok=True)
        atomic_save(
            {
                "format": CHECKPOINT_FORMAT,
                "world_size": comm.size,
                "position": dict(position),
                "config": cfg.fingerprint(),
                "model": model.state_dict(),
                "optimizer": optimizer_state,
                "scaler": scaler.state_dict() if scaler is not None else None,
            },
            step_dir / "shared.pt",
        )
    comm.barrier()
    atomic_save(
        {
            "rank": comm.rank,
            "optimizer": optimizer_own,  # this rank's error-feedback residuals
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        },
        step_dir / f"rank-{comm.rank}.pt",
    )
    comm.barrier()
    if comm.rank == 0:
        (directory / "latest.tmp").write_text(step_dir.name + "\n")
        (directory / "latest.tmp").replace(directory / "latest")
        for old in sorted(directory.glob("step-*"))[:-2]:  # keep the last two
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier()
    return step_dir


def load_checkpoint(
    directory: Path, comm, cfg: Config, device, which: str = "latest"
) -> tuple[dict, dict]:
    """(shared state, this rank's state) of checkpoint ``which``, checked against ``cfg``."""
    if which == "latest":
        latest = directory / "latest"
        if not latest.is_file():
            raise RecipeError(
                f"--resume: no checkpoint in {directory} (no 'latest' file); "
                "run without --resume first, with --checkpoint-dir"
            )
        which = latest.read_text().strip()
    if not (directory / which).is_dir():
        found = ", ".join(sorted(p.name for p in directory.glob("step-*"))) or "none"
        raise RecipeError(f"--resume {which}: no such checkpoint in {directory} (found: {found})")
    shared_path, own_path = (
        directory / which / "shared.pt",
        directory / which / f"rank-{comm.rank}.pt",
    )
    for path in (shared_path, own_path):
        if not path.is_file():
            raise RecipeError(
                f"--resume: {path} is missing; was the checkpoint written by "
                f"{comm.size} ranks, on a folder every rank can read?"
            )
    shared = torch.load(shared_path, map_location=device, weights_only=True)
    if shared.get("format") != CHECKPOINT_FORMAT:
        raise RecipeError(f"--resume: {shared_path} is not a checkpoint of this recipe")
    if shared["world_size"] != comm.size:
        raise RecipeError(
            f"--resume: the checkpoint was written by {shared['world_size']} ranks; "
            f"resume with the same number (now {comm.size})"
        )
    now = cfg.fingerprint()
    diff = {k: (v, now.get(k)) for k, v in shared["config"].items() if now.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise RecipeError(
            f"--resume: settings differ from the checkpoint's run ({detail}); "
            "use the same options to resume exactly"
        )
    own = torch.load(own_path, map_location=device, weights_only=True)
    return shared, own


# --------------------------------------------------------------------------------------------


@torch.no_grad()
def average_bn_statistics(model, comm) -> None:
    """Each rank's BN running statistics saw only its own data: average them before use."""
    bufs = [b for name, b in model.named_buffers() if b.is_floating_point()]
    if comm.size == 1 or not bufs:
        return
    flat = torch.cat([b.reshape(-1).float() for b in bufs])
    comm.allreduce(flat)
    flat /= comm.size
    offset = 0
    for b in bufs:
        b.copy_(flat[offset : offset + b.numel()].view_as(b))
        offset += b.numel()


@torch.no_grad()
def evaluate(model, dataset, cfg: Config, comm, device, precision: MixedPrecision) -> dict:
    average_bn_statistics(model, comm)
    model.eval()
    per_rank = max(1, cfg.global_batch // comm.size)
    loader = make_loader(
        dataset,
        eval_shard(len(dataset), comm.rank, comm.size, per_rank),
        cfg.workers,
        device.type == "cuda",
    )
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with precision.autocast():
            out = model(x)
        totals[0] += criterion(out.float(), y).double()
        totals[1] += (out.argmax(1) == y).sum()
        totals[2] += y.numel()
    comm.allreduce(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return {"loss": loss_sum / max(count, 1), "top1": correct / max(count, 1), "count": int(count)}


def build_optimizer(model, cfg: Config):
    if cfg.optimizer == "lars":
        return LARS(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )


def train(cfg: Config, args: argparse.Namespace, comm, device) -> dict:
    try:
        precision = MixedPrecision.resolve(args.amp, device)
    except ValueError as exc:
        raise RecipeError(f"--amp {args.amp}: {exc}") from None
    torch.manual_seed(cfg.seed)
    train_set, val_set = make_datasets(
        cfg.data_kind,
        data_dir=cfg.data_dir,
        image_size=cfg.image_size,
        num_classes=cfg.num_classes,
        train_size=cfg.train_size,
        val_size=cfg.val_size,
        seed=cfg.seed,
    )
    num_classes = getattr(train_set, "num_classes", cfg.num_classes)
    model = resnet50(num_classes=num_classes, zero_init_residual=cfg.zero_init_residual).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
        torch.backends.cudnn.benchmark = True
    opt = multi_node_optimizer(build_optimizer(model, cfg), comm, args, model=model, seed=cfg.seed)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    steps_per_epoch = [len(train_set) // cfg.batch_at(e) for e in range(cfg.epochs)]
    total_steps = sum(steps_per_epoch)
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    position = {"epoch": 0, "step_in_epoch": 0, "global_step": 0}
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.resume:
        shared, own = load_checkpoint(ckpt_dir, comm, cfg, device, args.resume)
        model.load_state_dict(shared["model"])
        with torch.no_grad():
            for name, buf in model.named_buffers():
                buf.copy_(own["buffers"][name])
        opt.load_state_dict(join_rank_state(shared["optimizer"], own["optimizer"]))
        if precision.scaler is not None and shared["scaler"] is not None:
            precision.scaler.load_state_dict(shared["scaler"])
        torch.set_rng_state(own["torch_rng"].cpu())
        if own["cuda_rng"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(own["cuda_rng"].cpu())
        position = dict(shared["position"])
        del shared, own
    sources = {"model_source": model_source(model), "data_source": data_source(train_set)}
    log = RunLog(
        rank=comm.rank,
        path=args.log_jsonl,
        progress=args.progress,
        total=total_steps,
        initial=position["global_step"],
    )
    log.event(
        "config",
        world_size=comm.size,
        device=str(device),
        amp=precision.name,
        **sources,
        label=config_label(args),
        resumed_at=position["global_step"],
        **asdict(cfg),
    )
    log.write(
        f"resnet50 {cfg.preset}: {comm.size} rank(s) on {device}, global batch "
        f"{cfg.global_batch}, {cfg.optimizer} lr {cfg.lr:g}, comm {config_label(args)}"
        + (f", resumed at step {position['global_step']}" if position["global_step"] else "")
    )
    log.write(f"model: {sources['model_source']}; data: {sources['data_source']}")

    clock = {"paused": 0.0}  # seconds spent in evaluation and checkpoints: not training

    def paused(fn):
        """Run ``fn`` and book its time as paused, so throughput counts training only."""
        t0 = time.perf_counter()
        result = fn()
        clock["paused"] += time.perf_counter() - t0
        return result

    def checkpoint():
        if ckpt_dir is not None:
            path = paused(
                lambda: save_checkpoint(ckpt_dir, comm, position, model, opt, precision.scaler, cfg)
            )
            log.event("checkpoint", step=position["global_step"], path=str(path))

    def run_eval(final: bool = False):
        def at_true_weights():  # compensated double buffering: predicted weights between steps
            with opt.true_weights():
                return evaluate(model, val_set, cfg, comm, device, precision)

        result = paused(at_true_weights)
        now = time.perf_counter()
        log.event(
            "eval",
            step=position["global_step"],
            epoch=position["epoch"],
            elapsed_s=round(now - run_start, 3),
            train_s=round(now - run_start - clock["paused"], 3),
            final=final,
            **result,
        )
        what = "final eval" if final else f"eval at step {position['global_step']}"
        log.write(f"{what}: top1 {result['top1']:.4f} loss {result['loss']:.4f}")
        return result

    metrics = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    last_log_time, last_log_step = time.perf_counter(), position["global_step"]
    paused_at_log = 0.0
    timed_from = None  # (time, images, paused) after the first step: start-up is not throughput
    images_done = 0
    run_start, first_step = time.perf_counter(), position["global_step"]
    last_eval = None
    stop = total_steps <= position["global_step"]
    while not stop and position["epoch"] < cfg.epochs:
        epoch = position["epoch"]
        batch = cfg.batch_at(epoch)
        train_set.set_epoch(epoch)
        sampler = EpochBatches(
            len(train_set),
            batch,
            comm.rank,
            comm.size,
            cfg.seed,
            epoch,
            start=position["step_in_epoch"],
        )
        loader = make_loader(train_set, sampler, cfg.workers, device.type == "cuda")
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if device.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            lr = cfg.lr_at(epoch + position["step_in_epoch"] / steps_per_epoch[epoch])
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            with precision.autocast():
                out = model(x)
                loss = criterion(out, y)
            precision.backward(loss)
            precision.step(opt)
            with torch.no_grad():
                metrics += torch.stack(
                    [
                        loss.detach().double() * y.numel(),
                        (out.argmax(1) == y).sum().double(),
                        torch.tensor(float(y.numel()), dtype=torch.float64, device=device),
                    ]
                )
            position["step_in_epoch"] += 1
            position["global_step"] += 1
            images_done += batch
            step = position["global_step"]
            if step == first_step + 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                timed_from = (time.perf_counter(), images_done, clock["paused"])
            epoch_done = position["step_in_epoch"] >= steps_per_epoch[epoch]
            stop = step >= total_steps
            if step % cfg.log_every == 0 or epoch_done or stop:
                comm.allreduce(metrics)  # the one host synchronisation of a log interval
                loss_sum, correct, count = metrics.tolist()
                now = time.perf_counter()
                busy = now - last_log_time - (clock["paused"] - paused_at_log)
                ips = (step - last_log_step) * batch / max(busy, 1e-9)
                record = dict(
                    step=step,
                    epoch=round(epoch + position["step_in_epoch"] / steps_per_epoch[epoch], 4),
                    lr=lr,
                    loss=loss_sum / count,
                    top1=correct / count,
                    images_per_s=round(ips, 2),
                    elapsed_s=round(now - run_start, 3),
                )
                log.event("train", **record)
                log.advance(
                    step - last_log_step,
                    f"epoch {record['epoch']:.2f} loss {record['loss']:.4f} "
                    f"top1 {record['top1']:.3f} {ips:.1f} img/s lr {lr:.4g}",
                )
                metrics.zero_()
                last_log_time, last_log_step, paused_at_log = now, step, clock["paused"]
            if epoch_done:
                position["epoch"] += 1
                position["step_in_epoch"] = 0
            if (
                not args.no_eval
                and not stop
                and (
                    (epoch_done and args.eval_every and position["epoch"] % args.eval_every == 0)
                    or (args.eval_every_steps and step % args.eval_every_steps == 0)
                )
            ):
                last_eval = run_eval()
            if epoch_done or stop or (args.checkpoint_every and step % args.checkpoint_every == 0):
                checkpoint()
            if stop:
                break
    # With double buffering the last step's gradients are still pending: apply them.
    if hasattr(opt, "flush"):
        opt.flush()
    end, paused_at_end = time.perf_counter(), clock["paused"]
    if not args.no_eval:
        last_eval = run_eval(final=True)
    summary = {
        "steps": position["global_step"] - first_step,
        "global_step": position["global_step"],
        "world_size": comm.size,
        "label": config_label(args),
        "elapsed_s": round(end - run_start, 3),
        "digest": state_digest(model),
    }
    if timed_from is not None and images_done > timed_from[1]:
        busy = end - timed_from[0] - (paused_at_end - timed_from[2])
        summary["images_per_s"] = round((images_done - timed_from[1]) / busy, 2)
    if last_eval is not None:
        summary["top1"] = last_eval["top1"]
    log.event("done", **summary)
    log.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = resolve(args)
        # The launcher says how many ranks there are before any collective: a bad batch is
        # reported by every rank at once instead of hanging the ones that got further.
        check_world(cfg, launch_info().size if args.communicator != "local" else 1)
        if args.threads:
            torch.set_num_threads(args.threads)
        device = choose_device(args.device)
        comm = create_communicator(args.communicator)
        check_world(cfg, comm.size)
        summary = train(cfg, args, comm, device)
    except (RecipeError, DataError) as exc:
        if launch_info().rank == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if comm.rank == 0:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
