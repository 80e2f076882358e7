"""fairseq's inverse square-root learning-rate schedule, as a function of the update count.

Linear warm-up from ``warmup_init_lr`` to ``lr`` over ``warmup_updates`` updates, then
``lr * sqrt(warmup_updates / n)``. ``n`` is the number of updates already applied, so the
first update runs at ``warmup_init_lr``. Being a pure function of ``n``, the schedule
resumes exactly from the update count saved in a checkpoint.

    >>> inverse_sqrt_lr(0, lr=1e-3, warmup_updates=4000, warmup_init_lr=1e-7)
    1e-07
    >>> inverse_sqrt_lr(4000, lr=1e-3, warmup_updates=4000)
    0.001
    >>> inverse_sqrt_lr(16000, lr=1e-3, warmup_updates=4000)
    0.0005
"""

from __future__ import annotations

import math


def inverse_sqrt_lr(
    num_updates: int, *, lr: float, warmup_updates: int, warmup_init_lr: float = 0.0
) -> float:
    if num_updates < warmup_updates:
        return warmup_init_lr + num_updates * (lr - warmup_init_lr) / warmup_updates
    if warmup_updates == 0:
        return lr / math.sqrt(max(num_updates, 1))
    return lr * math.sqrt(warmup_updates / num_updates)


def set_lr(optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value
