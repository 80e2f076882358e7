"""The recipe's ResNet-50 is the package's one definition, ``commopt.sim.resnet``: torchvision's
model when torchvision imports, else the same network built there (same layer names, shapes and
initialisation, so checkpoints load in either).

    >>> m = resnet50(num_classes=10, prefer_torchvision=False)
    >>> sum(p.numel() for p in m.parameters())
    23528522
"""

from commopt.sim.resnet import (
    ResNet,
    model_source,
    resnet50,
    torchvision_available,
    torchvision_import_error,
)

__all__ = [
    "ResNet",
    "model_source",
    "resnet50",
    "torchvision_available",
    "torchvision_import_error",
]
