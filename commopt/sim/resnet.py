"""ResNet-50 (v1.5): torchvision's model when torchvision imports, else the same network built here.

The one ResNet-50 of the project: the simulator profiles it (``model_specs``, ``profiler``) and
the ResNet-50 recipe trains it (``recipes/resnet50/model.py`` re-exports this module). The
fallback exists because torchvision is an optional dependency and the registry's torchvision
wheels are CUDA builds: next to a CPU-only torch ``import torchvision`` fails in its native-op
registration, and the set-up (scripts/setup_torchvision.sh) removes such a build. The fallback
has torchvision's layer names, shapes and initialisation (bottlenecks [3, 4, 6, 3], stride on
the 3x3 convolution, 1x1 projection shortcuts; 25,557,032 parameters at 1000 classes), so
profiles and checkpoints agree either way. :func:`model_source` says which one a model is.

    >>> sum(p.numel() for p in resnet50(prefer_torchvision=False).parameters())
    25557032
    >>> m = resnet50(num_classes=10, prefer_torchvision=False)
    >>> sum(p.numel() for p in m.parameters())
    23528522
    >>> model_source(m).startswith("built-in ResNet-50")
    True
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = [
    "ResNet",
    "model_source",
    "resnet50",
    "torchvision_available",
    "torchvision_import_error",
]


@functools.lru_cache(maxsize=1)
def torchvision_import_error() -> str | None:
    """None when ``torchvision.models`` imports with this torch, else the error, one line."""
    try:
        import torchvision.models  # noqa: F401
    except Exception as exc:  # ImportError, or RuntimeError/OSError from a CUDA-only wheel
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def torchvision_available() -> bool:
    """True when ``torchvision.models`` imports (its native ops load with this torch)."""
    return torchvision_import_error() is None


def resnet50(
    num_classes: int = 1000, zero_init_residual: bool = False, prefer_torchvision: bool = True
) -> nn.Module:
    """ResNet-50 (v1.5: stride on the 3x3 convolution), randomly initialised."""
    if prefer_torchvision and torchvision_available():
        import torchvision

        return torchvision.models.resnet50(
            weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual
        )
    return ResNet([3, 4, 6, 3], num_classes=num_classes, zero_init_residual=zero_init_residual)


def model_source(model: nn.Module) -> str:
    """Where ``model`` comes from, for the log: torchvision (with its version) or built-in."""
    if not isinstance(model, ResNet):
        import torchvision

        return f"torchvision {torchvision.__version__} models.resnet50"
    why = torchvision_import_error()
    return "built-in ResNet-50" + (f" (torchvision does not import: {why})" if why else "")


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(
        self, in_ch: int, width: int, stride: int = 1, downsample: nn.Module | None = None
    ):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + shortcut)


class ResNet(nn.Module):
    def __init__(
        self, blocks: list[int], num_classes: int = 1000, zero_init_residual: bool = False
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = 64
        stages = []
        for i, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512), strict=True)):
            stride = 1 if i == 0 else 2
            layer, in_ch = self._stage(in_ch, width, n, stride)
            stages.append(layer)
        # named attributes (not setattr) so forward's calls have a type
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            # Each block starts as the identity: helps large-batch warm-up (Goyal et al.).
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    @staticmethod
    def _stage(in_ch: int, width: int, n: int, stride: int):
        out_ch = width * Bottleneck.expansion
        downsample = None
        if stride != 1 or in_ch != out_ch:
            downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )
        layers = [Bottleneck(in_ch, width, stride, downsample)]
        layers += [Bottleneck(out_ch, width) for _ in range(n - 1)]
        return nn.Sequential(*layers), out_ch

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
