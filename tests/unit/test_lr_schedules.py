"""The recipes' LR schedules: pure functions, their LRScheduler forms, the MLPerf defaults."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commopt.optim.lr_schedules import (
    CHAINERMN_MILESTONES,
    PolyWarmup,
    StepWarmup,
    chainermn_step_lr,
    mlperf_lars_defaults,
    poly_warmup_lr,
    step_warmup_lr,
)


def test_poly_warmup_key_points():
    kw = dict(base_lr=10.0, total_steps=110, warmup_steps=10, power=2.0, end_lr=1e-4)
    assert poly_warmup_lr(0, **kw) == 0.0
    assert poly_warmup_lr(5, **kw) == pytest.approx(5.0)
    assert poly_warmup_lr(10, **kw) == pytest.approx(10.0)
    # half-way through the decay: end + (base - end) * 0.5 ** 2
    assert poly_warmup_lr(60, **kw) == pytest.approx(1e-4 + (10.0 - 1e-4) * 0.25)
    assert poly_warmup_lr(110, **kw) == pytest.approx(1e-4)
    assert poly_warmup_lr(500, **kw) == pytest.approx(1e-4)  # held past the end


@settings(max_examples=100, deadline=None)
@given(
    total=st.integers(1, 10_000),
    warm_frac=st.floats(0.0, 1.0),
    power=st.sampled_from([1.0, 2.0]),
    base=st.floats(0.01, 50.0),
)
def test_poly_warmup_rises_then_falls_and_stays_in_range(total, warm_frac, power, base):
    warm = int(total * warm_frac)
    lrs = [
        poly_warmup_lr(
            s, base_lr=base, total_steps=total, warmup_steps=warm, power=power, end_lr=1e-4
        )
        for s in range(0, total + 1, max(1, total // 50))
    ]
    peak = lrs.index(max(lrs))
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(lrs[: peak + 1]))
    assert all(a >= b - 1e-12 for a, b in zip(lrs[peak:], lrs[peak + 1 :]))
    assert max(lrs) <= base + 1e-9 and min(lrs) >= 0.0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(total_steps=0, warmup_steps=0), "total_steps"),
        (dict(total_steps=10, warmup_steps=11), "warmup_steps"),
        (dict(total_steps=10, warmup_steps=-1), "warmup_steps"),
    ],
)
def test_poly_warmup_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        poly_warmup_lr(0, base_lr=1.0, **kw)


def test_chainermn_schedule():
    base = 3.2
    assert step_warmup_lr(0.0, base_lr=base) == pytest.approx(0.32)  # Goyal et al.: start at 1/10
    assert step_warmup_lr(2.5, base_lr=base) == pytest.approx(0.32 + (3.2 - 0.32) * 0.5)
    assert step_warmup_lr(2.5, base_lr=base, warmup_start_factor=0.0) == pytest.approx(1.6)
    assert step_warmup_lr(5.0, base_lr=base) == pytest.approx(3.2)
    assert step_warmup_lr(29.99, base_lr=base) == pytest.approx(3.2)
    assert step_warmup_lr(30.0, base_lr=base) == pytest.approx(3.2 * 0.2)
    assert step_warmup_lr(60.0, base_lr=base) == pytest.approx(3.2 * 0.02)
    assert step_warmup_lr(89.0, base_lr=base) == pytest.approx(3.2 * 0.002)
    assert chainermn_step_lr(70.0, base) == step_warmup_lr(70.0, base_lr=base)
    assert CHAINERMN_MILESTONES == ((30, 0.2), (60, 0.1), (80, 0.1))


def test_mlperf_lars_defaults_by_global_batch():
    assert (mlperf_lars_defaults(256).base_lr, mlperf_lars_defaults(256).warmup_epochs) == (10.0, 5)
    assert mlperf_lars_defaults(16383).base_lr == 10.0
    assert (mlperf_lars_defaults(16384).base_lr, mlperf_lars_defaults(16384).warmup_epochs) == (
        25.0,
        5,
    )
    assert mlperf_lars_defaults(32767).base_lr == 25.0
    d = mlperf_lars_defaults(32768)
    assert (d.base_lr, d.warmup_epochs, d.power, d.end_lr, d.label_smoothing) == (
        31.2,
        25,
        2.0,
        1e-4,
        0.1,
    )
    with pytest.raises(ValueError, match="global_batch"):
        mlperf_lars_defaults(0)


def _opt(lr):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9)


def test_poly_warmup_scheduler_matches_function():
    opt = _opt(4.0)
    sched = PolyWarmup(opt, total_steps=20, warmup_steps=4, power=2.0, end_lr=1e-3)
    seen = []
    for _ in range(25):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [
        poly_warmup_lr(s, base_lr=4.0, total_steps=20, warmup_steps=4, end_lr=1e-3)
        for s in range(25)
    ]
    assert seen == pytest.approx(expected)
    # resume: a fresh scheduler loaded from the state continues at the same LR
    opt2 = _opt(4.0)
    sched2 = PolyWarmup(opt2, total_steps=20, warmup_steps=4, power=2.0, end_lr=1e-3)
    sched2.load_state_dict(sched.state_dict())
    assert sched2.get_lr() == pytest.approx([expected[-1]])


def test_step_warmup_scheduler_matches_function():
    opt = _opt(1.0)
    sched = StepWarmup(opt, steps_per_epoch=2, warmup_epochs=5)
    seen = []
    for _ in range(2 * 90):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([step_warmup_lr(s / 2, base_lr=1.0) for s in range(180)])
    with pytest.raises(ValueError, match="steps_per_epoch"):
        StepWarmup(_opt(1.0), steps_per_epoch=0)
