"""Models and synthetic tasks for the step benchmark (``commopt bench step``).

    >>> spec = MODELS["tiny"]
    >>> model = spec.build()
    >>> x, y = spec.batch(step=0, rank=0, size=spec.batch_size)
    >>> tuple(model(x).shape) == (spec.batch_size, spec.classes)
    True

Two kinds of model, chosen for where their step time goes on a 1 Gbit/s link:

- ``mlp``: a wide MLP of 25.2M parameters at a small batch (8 per rank). Its fp32 gradient
  (101 MB) takes 0.8 s to allreduce between 2 hosts at 1 Gbit/s, several times one step's
  compute: communication-bound.
- ``cnn``: a small convolutional network (0.24M parameters, 1 MB of gradient, 8 ms on the
  link) at batch 128 of 32x32 images: compute-bound.
- ``tiny``: a few thousand parameters, for tests.

Every task is a classification with a known answer (class means plus noise), so the loss
falls within tens of steps and the final loss compares codecs on equal terms. Data depend
only on (step, rank): every configuration sees the same batches.

torch is imported only when a model or batch is made: `commopt bench` builds its options
from ``MODELS`` at every start of the command line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["MODELS", "ModelSpec", "param_shapes"]

# Seeds: the task (class means) is the same for every rank and run; eval data never
# coincide with a training batch.
_TASK_SEED = 1234
_EVAL_SEED = 987_654_321
_MEANS: dict[str, torch.Tensor] = {}


@dataclass(frozen=True)
class ModelSpec:
    """A model and its synthetic task.

    ``build()`` returns the model (call ``torch.manual_seed`` first for a fixed init);
    ``batch(step, rank, size)`` returns (inputs, labels) for that rank's share of a step;
    ``eval_batch(size)`` a fixed held-out batch. ``lr`` suits SGD with momentum 0.9.
    """

    name: str
    description: str
    batch_size: int
    lr: float
    classes: int
    input_shape: tuple[int, ...]
    signal: float  # scale of the class means against unit noise
    steps: int  # timed steps per round in the step benchmark
    block: int  # timed steps between two compute-only measurements there
    role: str  # what bounds its step on a slow link: "communication", "compute" or "test"
    factory: Callable[[], nn.Module]

    def build(self) -> nn.Module:
        return self.factory()

    def _means(self) -> torch.Tensor:
        import torch

        if self.name not in _MEANS:
            g = torch.Generator().manual_seed(_TASK_SEED)
            _MEANS[self.name] = (
                torch.randn((self.classes, *self.input_shape), generator=g) * self.signal
            )
        return _MEANS[self.name]

    def _sample(self, g: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        labels = torch.randint(0, self.classes, (size,), generator=g)
        noise = torch.randn((size, *self.input_shape), generator=g)
        return self._means()[labels] + noise, labels

    def batch(self, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        # One generator per (step, rank): the same batch whatever ran before.
        return self._sample(torch.Generator().manual_seed(1_000_003 * step + rank + 1), size)

    def eval_batch(self, size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        return self._sample(torch.Generator().manual_seed(_EVAL_SEED), size)


def _wide_mlp(d_in: int = 1024, hidden: int = 4096, classes: int = 16) -> nn.Module:
    from torch import nn

    # 1024 -> 4096 -> 4096 -> 1024 -> 16: 25.2M parameters, three big matrices that
    # PowerSGD can factor and QSGD can quantise, plus a few small tensors.
    return nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, d_in),
        nn.GELU(),
        nn.Linear(d_in, classes),
    )


def _small_cnn(classes: int = 10) -> nn.Module:
    from torch import nn

    # 32x32 RGB -> 10 classes; 0.24M parameters but ~76 MFLOP per sample (fwd + bwd).
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(128, 128, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, classes),
    )


def _tiny_mlp() -> nn.Module:
    from torch import nn

    return nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(
        "mlp",
        "wide MLP 1024-4096-4096-1024-16 (25.2M params), communication-bound",
        batch_size=8,
        lr=0.05,
        classes=16,
        input_shape=(1024,),
        signal=0.3,
        steps=6,
        block=3,
        role="communication",
        factory=_wide_mlp,
    ),
    "cnn": ModelSpec(
        "cnn",
        "small CNN, 4 conv layers (0.24M params) on 3x32x32, compute-bound",
        batch_size=128,
        lr=0.1,
        classes=10,
        input_shape=(3, 32, 32),
        signal=1.0,
        steps=24,
        block=4,
        role="compute",
        factory=_small_cnn,
    ),
    "tiny": ModelSpec(
        "tiny",
        "MLP 32-64-64-4 (6.5k params), for tests",
        batch_size=16,
        lr=0.1,
        classes=4,
        input_shape=(32,),
        signal=0.5,
        steps=3,
        block=3,
        role="test",
        factory=_tiny_mlp,
    ),
}


def param_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    """Shapes of the trainable parameters, in registration order."""
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]
