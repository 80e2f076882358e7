"""Images for the ResNet-50 recipe: an ImageNet folder (ImageFolder layout) or synthetic data.

Three kinds (``make_datasets``): ``folder``; ``synthetic``, learnable class patterns made
here; ``fake``, torchvision's ``FakeData`` (random images and random labels: for speed
only, it cannot be learned) when torchvision imports, else the ``synthetic`` images.

Every random choice (shuffling, crops, flips, synthetic pixels) is a function of
``(seed, epoch, index)``, never of a global random state, so a run resumed from a checkpoint
sees exactly the batches the uninterrupted run would have seen, and each global batch is
the same whatever the number of ranks.

    >>> ds = SyntheticImages(num_samples=8, num_classes=4, image_size=16, seed=0)
    >>> x, y = ds[3]
    >>> tuple(x.shape), y
    ((3, 16, 16), 3)
    >>> sampler = EpochBatches(len(ds), global_batch=4, rank=1, world_size=2, seed=0, epoch=0)
    >>> len(sampler), len(next(iter(sampler)))
    (2, 2)
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".webp", ".tif", ".tiff")


class DataError(ValueError):
    """The data folder is missing or not in ImageFolder layout."""


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers: stable across processes (unlike hash())."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


class SyntheticImages(Dataset):
    """Learnable synthetic classification data: a smooth per-class pattern plus noise.

    Sample ``i`` has label ``i % num_classes`` and pixels drawn from ``(seed, i)`` only; the
    class patterns come from ``pattern_seed`` (default ``seed``), so a validation set with
    another ``seed`` and the same ``pattern_seed`` holds new samples of the same classes.
    """

    def __init__(
        self,
        num_samples: int,
        num_classes: int,
        image_size: int,
        seed: int = 0,
        noise: float = 3.0,
        pattern_seed: int | None = None,
    ):
        if num_samples <= 0 or num_classes <= 0 or image_size <= 0:
            raise ValueError("SyntheticImages: num_samples, num_classes and image_size must be > 0")
        self.num_samples, self.num_classes, self.image_size = num_samples, num_classes, image_size
        self.seed, self.noise = seed, noise
        self.pattern_seed = seed if pattern_seed is None else pattern_seed

    def prototype(self, label: int) -> torch.Tensor:
        """Class ``label``'s pattern: 4x4 random values per channel, smoothly upsampled."""
        gen = torch.Generator().manual_seed(_mix(self.pattern_seed, 0xC1A55, label))
        coarse = torch.randn(1, 3, 4, 4, generator=gen)
        return torch.nn.functional.interpolate(
            coarse, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
        )[0]

    def set_epoch(self, epoch: int) -> None:  # no augmentation: same pixels every epoch
        pass

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        label = index % self.num_classes
        gen = torch.Generator().manual_seed(_mix(self.seed, index))
        x = self.prototype(label) + self.noise * torch.randn(
            3, self.image_size, self.image_size, generator=gen
        )
        return x, label


class FakeImages(Dataset):
    """torchvision's ``FakeData`` as normalised tensors: image ``i`` and its label are drawn
    from ``(seed, i)`` only (FakeData seeds each index), so resumes and rank counts see the
    same samples. Needs torchvision (see :func:`recipes.resnet50.model.torchvision_available`).
    """

    def __init__(self, num_samples: int, num_classes: int, image_size: int, seed: int = 0):
        import torchvision
        from torchvision import transforms

        self.num_classes = num_classes
        self.fake = torchvision.datasets.FakeData(
            size=num_samples,
            image_size=(3, image_size, image_size),
            num_classes=num_classes,
            transform=transforms.Compose(
                [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
            ),
            random_offset=_mix(seed, 0xFA4E) % (1 << 40),
        )

    def set_epoch(self, epoch: int) -> None:  # no augmentation
        pass

    def __len__(self) -> int:
        return len(self.fake)

    def __getitem__(self, index: int):
        return self.fake[index]


def data_source(dataset) -> str:
    """What ``dataset`` is, for the log."""
    if isinstance(dataset, FakeImages):
        import torchvision

        return f"torchvision {torchvision.__version__} FakeData ({len(dataset)} images)"
    if isinstance(dataset, SyntheticImages):
        return f"built-in synthetic images ({len(dataset)})"
    return f"image folder {getattr(dataset, 'root', '?')} ({len(dataset)} images)"


def find_images(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Classes (sorted sub-folder names) and (path, class index) pairs under ``root``."""
    if not root.is_dir():
        raise DataError(f"data folder {str(root)!r} not found")
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    if not classes:
        raise DataError(
            f"{str(root)!r} has no class sub-folders: expected ImageFolder layout "
            f"{root}/<class>/<image>.JPEG"
        )
    samples = []
    for idx, name in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(root / name)):
            samples.extend(
                (os.path.join(dirpath, f), idx)
                for f in sorted(files)
                if f.lower().endswith(IMAGE_SUFFIXES)
            )
    if not samples:
        raise DataError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {str(root)!r}")
    return classes, samples


class ImageFolderImages(Dataset):
    """``root/<class>/<image>`` files as normalised tensors.

    Training: a random-resized crop (8-100% of the area, aspect 3/4-4/3) and a random flip,
    drawn from ``(seed, epoch, index)``. Evaluation: resize the short side to
    ``image_size / 0.875``, then a centre crop.
    """

    def __init__(self, root: str | Path, image_size: int, train: bool, seed: int = 0):
        try:
            import PIL.Image  # noqa: F401
        except ImportError as exc:
            raise ImportError("reading image folders needs Pillow: pip install pillow") from exc
        self.root = Path(root)
        self.classes, self.samples = find_images(self.root)
        self.image_size, self.train, self.seed = image_size, train, seed
        self.epoch = 0
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as img:
            img = img.convert("RGB")
            if self.train:
                rng = random.Random(_mix(self.seed, self.epoch, index))
                img = self._random_resized_crop(img, rng)
                if rng.random() < 0.5:
                    img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            else:
                img = self._center_crop(img)
            x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
        x = x.float().div_(255.0)
        return (x - self.mean) / self.std, label

    def _random_resized_crop(self, img, rng: random.Random):
        from PIL import Image

        w, h = img.size
        s = self.image_size
        for _ in range(10):
            area = w * h * rng.uniform(0.08, 1.0)
            aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
                return img.resize((s, s), Image.Resampling.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
        return self._center_crop(img)  # a very thin image: fall back to the evaluation crop

    def _center_crop(self, img):
        from PIL import Image

        w, h = img.size
        short = max(1, round(self.image_size / 0.875))
        scale = short / min(w, h)
        img = img.resize(
            (max(short, round(w * scale)), max(short, round(h * scale))), Image.Resampling.BILINEAR
        )
        w, h = img.size
        s = self.image_size
        x0, y0 = (w - s) // 2, (h - s) // 2
        return img.crop((x0, y0, x0 + s, y0 + s))


class EpochBatches(Sampler):
    """This rank's share of each global batch of one epoch.

    The epoch's order is a permutation seeded by ``(seed, epoch)``; global batch ``k`` is
    positions ``[k*B, (k+1)*B)`` of it (the tail that does not fill a batch is dropped) and
    rank ``r`` takes the ``r``-th slice of ``B / world_size``. ``start`` skips the first
    batches, for resuming mid-epoch.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        epoch: int,
        start: int = 0,
    ):
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by {world_size} ranks")
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, epoch
        self.start = start
        self.steps = num_samples // global_batch
        if self.steps == 0:
            raise ValueError(
                f"the data set has {num_samples} samples, fewer than one global batch "
                f"of {global_batch}: use a smaller --batch-size"
            )

    def __len__(self) -> int:
        return max(0, self.steps - self.start)

    def __iter__(self):
        gen = torch.Generator().manual_seed(_mix(self.seed, self.epoch, 0x5A3D))
        order = torch.randperm(self.num_samples, generator=gen)
        per_rank = self.global_batch // self.world_size
        for k in range(self.start, self.steps):
            lo = k * self.global_batch + self.rank * per_rank
            yield order[lo : lo + per_rank].tolist()


def eval_shard(num_samples: int, rank: int, world_size: int, batch: int) -> list[list[int]]:
    """Every sample exactly once over all ranks (rank r takes r, r+n, ...), in batches."""
    mine = list(range(rank, num_samples, world_size))
    return [mine[i : i + batch] for i in range(0, len(mine), batch)]


def make_datasets(
    kind: str,
    *,
    data_dir: str | None,
    image_size: int,
    num_classes: int,
    train_size: int,
    val_size: int,
    seed: int,
):
    """(train, val) data sets; ``kind`` is "synthetic", "fake" or "folder" (``data_dir/train``, ``/val``).

    "fake" is torchvision's FakeData when torchvision imports, else "synthetic".
    """
    if kind == "fake":
        from recipes.resnet50.model import torchvision_available

        if torchvision_available():
            return (
                FakeImages(train_size, num_classes, image_size, seed=seed),
                FakeImages(val_size, num_classes, image_size, seed=seed + 1),
            )
        kind = "synthetic"
    if kind == "synthetic":
        train = SyntheticImages(train_size, num_classes, image_size, seed=seed)
        # same classes, fresh noise
        val = SyntheticImages(val_size, num_classes, image_size, seed=seed + 1, pattern_seed=seed)
        return train, val
    if kind != "folder":
        raise ValueError(f"unknown data kind {kind!r}: use 'synthetic', 'fake' or 'folder'")
    if not data_dir:
        raise DataError(
            "this preset reads ImageNet from a folder: give --data DIR (with train/ "
            "and val/ in ImageFolder layout) or use --synthetic"
        )
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(
            f"--data {data_dir}: folder not found. Give a folder with train/<class>/*.JPEG "
            "and val/<class>/*.JPEG (ImageFolder layout), or use --synthetic"
        )
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise DataError(
                f"--data {data_dir}: no {split}/ sub-folder. Expected {data_dir}/train/"
                f"<class>/*.JPEG and {data_dir}/val/<class>/*.JPEG (ImageFolder layout)"
            )
    train = ImageFolderImages(root / "train", image_size, train=True, seed=seed)
    val = ImageFolderImages(root / "val", image_size, train=False, seed=seed)
    if train.classes != val.classes:
        raise DataError(
            f"--data {data_dir}: train/ has {len(train.classes)} classes and val/ has "
            f"{len(val.classes)}; they must have the same class folders"
        )
    return train, val


def make_loader(dataset, batch_sampler, workers: int, pin_memory: bool) -> DataLoader:
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=False,
    )
