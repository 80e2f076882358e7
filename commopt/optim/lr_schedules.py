"""Learning-rate schedules of the large-batch recipes, as pure functions and LR schedulers.

* ``poly_warmup_lr``: linear warm-up from 0 to ``base_lr``, then polynomial decay to
  ``end_lr`` (the MLPerf ResNet-50 LARS schedule: power 2, end LR 1e-4, published).
* ``step_warmup_lr``: the ChainerMN ImageNet schedule (published): gradual warm-up over 5
  epochs, then LR x0.2 at epoch 30, x0.1 at 60 and x0.1 at 80.
* ``mlperf_lars_defaults(global_batch)``: base LR, warm-up epochs and the rest of the MLPerf
  LARS recipe, chosen by the global batch size.

The functions take the position in training (a step, or a fractional epoch) and return the
LR, so a recipe can set ``group["lr"]`` itself and resume exactly from a step count alone.
``PolyWarmup`` and ``StepWarmup`` are the same schedules as torch's ``LambdaLR``.

    >>> poly_warmup_lr(0, base_lr=10.0, total_steps=100, warmup_steps=10)
    0.0
    >>> poly_warmup_lr(10, base_lr=10.0, total_steps=100, warmup_steps=10)
    10.0
    >>> poly_warmup_lr(100, base_lr=10.0, total_steps=100, warmup_steps=10)
    0.0001
    >>> step_warmup_lr(45.0, base_lr=1.0)  # after the x0.2 at epoch 30
    0.2
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "CHAINERMN_MILESTONES",
    "LarsDefaults",
    "PolyWarmup",
    "StepWarmup",
    "chainermn_step_lr",
    "mlperf_lars_defaults",
    "poly_warmup_lr",
    "step_warmup_lr",
]

# (epoch, factor): the LR is multiplied by each factor once its epoch is reached (published).
CHAINERMN_MILESTONES: tuple[tuple[float, float], ...] = ((30, 0.2), (60, 0.1), (80, 0.1))


def poly_warmup_lr(
    step: float,
    *,
    base_lr: float,
    total_steps: float,
    warmup_steps: float,
    power: float = 2.0,
    end_lr: float = 1e-4,
) -> float:
    """LR at ``step`` (int or fractional) of ``total_steps``.

    Warm-up: ``base_lr * step / warmup_steps``. Then
    ``end_lr + (base_lr - end_lr) * (1 - (step - warmup) / (total - warmup)) ** power``,
    held at ``end_lr`` past ``total_steps``.
    """
    if total_steps <= 0:
        raise ValueError(f"poly_warmup_lr: total_steps must be > 0, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"poly_warmup_lr: warmup_steps must be in [0, total_steps={total_steps}], "
            f"got {warmup_steps}"
        )
    if step < 0:
        raise ValueError(f"poly_warmup_lr: step must be >= 0, got {step}")
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps == 0:
        return end_lr
    remaining = max(0.0, 1.0 - (step - warmup_steps) / decay_steps)
    return float(end_lr + (base_lr - end_lr) * remaining**power)


def step_warmup_lr(
    epoch: float,
    *,
    base_lr: float,
    warmup_epochs: float = 5.0,
    warmup_start_factor: float = 0.1,
    milestones: tuple[tuple[float, float], ...] = CHAINERMN_MILESTONES,
) -> float:
    """LR at a fractional ``epoch``: linear warm-up from ``warmup_start_factor * base_lr`` to
    ``base_lr`` over ``warmup_epochs``, then ``base_lr`` times every milestone factor reached.

    The default start factor 0.1 follows the gradual warm-up of Goyal et al. that ChainerMN
    used (start from the LR of a small batch); pass 0.0 to start from zero.
    """
    if epoch < 0:
        raise ValueError(f"step_warmup_lr: epoch must be >= 0, got {epoch}")
    if warmup_epochs < 0:
        raise ValueError(f"step_warmup_lr: warmup_epochs must be >= 0, got {warmup_epochs}")
    if epoch < warmup_epochs:
        frac = epoch / warmup_epochs
        return base_lr * (warmup_start_factor + (1.0 - warmup_start_factor) * frac)
    lr = base_lr
    for at, factor in sorted(milestones):
        if epoch >= at:
            lr *= factor
    return lr


def chainermn_step_lr(epoch: float, base_lr: float) -> float:
    """The published ChainerMN ImageNet schedule: ``step_warmup_lr`` with its defaults."""
    return step_warmup_lr(epoch, base_lr=base_lr)


def _relative(schedule: Callable[[int, float], float], base: float, step: int) -> float:
    """``schedule``'s LR at ``step`` as a multiple of ``base``: what LambdaLR multiplies by."""
    return schedule(step, base) / base if base else 0.0


def _lambdas(
    optimizer: Optimizer, last_epoch: int, schedule: Callable[[int, float], float]
) -> list[Callable[[int], float]]:
    # LambdaLR multiplies each group's initial LR by its lambda; on resume (last_epoch >= 0)
    # the initial LR is the one torch kept in the group, as for every torch scheduler.
    key = "initial_lr" if last_epoch >= 0 else "lr"
    return [functools.partial(_relative, schedule, g[key]) for g in optimizer.param_groups]


class PolyWarmup(LambdaLR):
    """``poly_warmup_lr`` as torch's ``LambdaLR``, stepped once per step; each group's initial
    LR is its base LR.

        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        >>> sched = PolyWarmup(opt, total_steps=10, warmup_steps=2, end_lr=0.0)
        >>> [round(g["lr"], 3) for g in opt.param_groups]  # step 0 of the warm-up
        [0.0]
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        power: float = 2.0,
        end_lr: float = 1e-4,
        last_epoch: int = -1,
    ):
        poly_warmup_lr(0, base_lr=1.0, total_steps=total_steps, warmup_steps=warmup_steps)
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        self.power, self.end_lr = power, end_lr
        schedule = functools.partial(
            _poly_at, total_steps=total_steps, warmup_steps=warmup_steps, power=power, end_lr=end_lr
        )
        super().__init__(optimizer, _lambdas(optimizer, last_epoch, schedule), last_epoch)


class StepWarmup(LambdaLR):
    """``step_warmup_lr`` as torch's ``LambdaLR``, stepped once per step
    (``steps_per_epoch`` steps an epoch)."""

    def __init__(
        self,
        optimizer: Optimizer,
        steps_per_epoch: int,
        warmup_epochs: float = 5.0,
        warmup_start_factor: float = 0.1,
        milestones: tuple[tuple[float, float], ...] = CHAINERMN_MILESTONES,
        last_epoch: int = -1,
    ):
        if steps_per_epoch <= 0:
            raise ValueError(f"StepWarmup: steps_per_epoch must be > 0, got {steps_per_epoch}")
        self.steps_per_epoch = steps_per_epoch
        self.warmup_epochs, self.warmup_start_factor = warmup_epochs, warmup_start_factor
        self.milestones = tuple(milestones)
        schedule = functools.partial(
            _step_at,
            steps_per_epoch=steps_per_epoch,
            warmup_epochs=warmup_epochs,
            warmup_start_factor=warmup_start_factor,
            milestones=self.milestones,
        )
        super().__init__(optimizer, _lambdas(optimizer, last_epoch, schedule), last_epoch)


def _poly_at(step: int, base: float, **kw: Any) -> float:
    return poly_warmup_lr(step, base_lr=base, **kw)


def _step_at(step: int, base: float, *, steps_per_epoch: int, **kw: Any) -> float:
    return step_warmup_lr(step / steps_per_epoch, base_lr=base, **kw)


@dataclass(frozen=True)
class LarsDefaults:
    """The MLPerf ResNet-50 LARS hyper-parameters for one global batch size."""

    base_lr: float
    warmup_epochs: float
    power: float = 2.0
    end_lr: float = 1e-4
    label_smoothing: float = 0.1
    momentum: float = 0.9
    # Not in the published list above; 5e-5 is the value of the MLPerf reference recipe.
    weight_decay: float = 5e-5
    trust_coefficient: float = 0.001


def mlperf_lars_defaults(global_batch: int) -> LarsDefaults:
    """Base LR and warm-up by global batch (published): < 16k: 10.0 / 5 epochs,
    < 32k: 25.0 / 5, >= 32k: 31.2 / 25 (k = 1024, so a batch of 32768 is ">= 32k").

        >>> mlperf_lars_defaults(4096).base_lr, mlperf_lars_defaults(32768).warmup_epochs
        (10.0, 25)
    """
    if global_batch <= 0:
        raise ValueError(f"mlperf_lars_defaults: global_batch must be > 0, got {global_batch}")
    if global_batch < 16 * 1024:
        return LarsDefaults(base_lr=10.0, warmup_epochs=5)
    if global_batch < 32 * 1024:
        return LarsDefaults(base_lr=25.0, warmup_epochs=5)
    return LarsDefaults(base_lr=31.2, warmup_epochs=25)
