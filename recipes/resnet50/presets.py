"""Named settings of the ResNet-50 recipe; every field can be overridden on the command line.

>>> p = PRESETS["imagenet-32gpu"]
>>> p.global_batch, p.optimizer, p.epochs
(2048, 'sgd', 90)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from commopt.optim.lr_schedules import CHAINERMN_MILESTONES

# ImageNet-1k's sizes: --synthetic on an ImageNet preset keeps the epoch length (and schedule).
IMAGENET_TRAIN, IMAGENET_VAL = 1_281_167, 50_000


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    data: str  # "synthetic" or "folder" (ImageFolder layout, needs --data)
    image_size: int
    num_classes: int
    global_batch: int  # images per step over all ranks
    epochs: int
    optimizer: str  # "sgd" (ChainerMN step schedule) or "lars" (MLPerf poly)
    lr: float | None = None  # None: 0.1 per 256 images for sgd, MLPerf table for lars
    momentum: float = 0.9
    weight_decay: float | None = None  # None: 1e-4 for sgd, MLPerf's 5e-5 for lars
    warmup_epochs: float | None = None  # None: 5 for sgd, MLPerf table for lars
    milestones: tuple = CHAINERMN_MILESTONES
    label_smoothing: float | None = None  # None: 0 for sgd, 0.1 for lars
    # (epoch, global batch) changes, e.g. ChainerMN's 64 -> 128 images per GPU at epoch 30.
    batch_schedule: tuple = ()
    zero_init_residual: bool = True
    synthetic_train_size: int = 0  # images of --synthetic data (0: the preset reads a folder)
    synthetic_val_size: int = 0
    workers: int = 0
    log_every: int = 10
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            name="smoke",
            description="synthetic 10-class 32x32 images, a few minutes on 2 CPU cores",
            data="synthetic",
            image_size=32,
            num_classes=10,
            global_batch=32,
            epochs=3,
            optimizer="sgd",
            lr=0.025,
            weight_decay=5e-5,
            warmup_epochs=1,
            milestones=((2, 0.2),),
            synthetic_train_size=1024,
            synthetic_val_size=256,
            log_every=4,
        ),
        Preset(
            name="imagenet-32gpu",
            description="ChainerMN's ImageNet setting: 32 GPUs x 64 images (128 from epoch 30), "
            "momentum SGD, 5-epoch warm-up, x0.2 at 30, x0.1 at 60 and 80, 90 epochs",
            data="folder",
            image_size=224,
            num_classes=1000,
            global_batch=32 * 64,
            epochs=90,
            optimizer="sgd",
            batch_schedule=((30, 32 * 128),),
            workers=8,
            log_every=50,
            synthetic_train_size=IMAGENET_TRAIN,
            synthetic_val_size=IMAGENET_VAL,
        ),
        Preset(
            name="imagenet-lars-32k",
            description="MLPerf-style LARS at a global batch of 32768: poly decay (power 2) to "
            "1e-4, base LR and warm-up from the MLPerf table, label smoothing 0.1",
            data="folder",
            image_size=224,
            num_classes=1000,
            global_batch=32 * 1024,
            epochs=90,
            optimizer="lars",
            workers=8,
            log_every=10,
            synthetic_train_size=IMAGENET_TRAIN,
            synthetic_val_size=IMAGENET_VAL,
        ),
    ]
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
