"""ResNet-50 for profiling: torchvision's when it imports, else an equivalent built here.

The fallback has torchvision's parameter names and shapes (bottlenecks [3, 4, 6, 3], stride on
the 3x3 convolution, 1x1 projection shortcuts), so profiles made either way agree; it exists
because torchvision is an optional dependency (and a CUDA build of it does not load on a CPU
torch).

    >>> sum(p.numel() for p in resnet50().parameters())
    25557032
"""
from __future__ import annotations

import torch
from torch import nn


class _Bottleneck(nn.Module):
    def __init__(self, inplanes: int, width: int, stride: int, downsample: bool):
        super().__init__()
        out = width * 4
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(out)) if downsample else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class _ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for i, (width, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]):
            layer = []
            for b in range(blocks):
                layer.append(_Bottleneck(inplanes, width, stride if b == 0 else 1, downsample=b == 0))
                inplanes = width * 4
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def torchvision_resnet50() -> nn.Module | None:
    """torchvision's ResNet-50 (random weights), or None if torchvision does not import."""
    try:
        import torchvision
    except Exception:   # missing, or a build that does not match this torch
        return None
    return torchvision.models.resnet50(weights=None)


def resnet50() -> nn.Module:
    return torchvision_resnet50() or _ResNet50()
