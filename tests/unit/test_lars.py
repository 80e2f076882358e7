"""LARS and the lars() wrapper against a float64 reference of the MLPerf rule."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commopt.optim.layerwise import LARS, exclude_bias_and_norm, lars, trust_ratios


def reference_lars(weights, grads_per_step, *, lr, momentum, wd, eta, eps, skip):
    """The published rule in float64 numpy, one parameter at a time."""
    ws = [w.astype(np.float64).copy() for w in weights]
    vs = [np.zeros_like(w) for w in ws]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            g = g.astype(np.float64)
            if skip[i]:
                update = lr * g
            else:
                wn, gn = np.linalg.norm(ws[i]), np.linalg.norm(g)
                trust = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
                update = lr * trust * (g + wd * ws[i])
            vs[i] = momentum * vs[i] + update
            ws[i] = ws[i] - vs[i]
    return ws


shapes = st.lists(
    st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4
)


@settings(max_examples=60, deadline=None)
@given(
    shapes=shapes,
    seed=st.integers(0, 2**31 - 1),
    steps=st.integers(1, 3),
    lr=st.floats(1e-3, 10.0),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    wd=st.sampled_from([0.0, 1e-4, 5e-5, 0.1]),
    eta=st.sampled_from([0.001, 0.02, 1.0]),
    eps=st.sampled_from([0.0, 1e-8, 1e-3]),
    zero_w=st.lists(st.booleans(), min_size=4, max_size=4),
    zero_g=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_lars_matches_float64_reference(
    shapes, seed, steps, lr, momentum, wd, eta, eps, zero_w, zero_g
):
    rng = np.random.default_rng(seed)
    weights = [
        np.asarray(rng.standard_normal(s) * (0.0 if zero_w[i] else 1.0), dtype=np.float32)
        for i, s in enumerate(shapes)
    ]
    grads = [
        [
            np.asarray(
                rng.standard_normal(s) * (0.0 if (zero_g[i] and k == 0) else 1.0), dtype=np.float32
            )
            for i, s in enumerate(shapes)
        ]
        for k in range(steps)
    ]
    params = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in weights]
    opt = LARS(params, lr=lr, momentum=momentum, weight_decay=wd, trust_coefficient=eta, eps=eps)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
    skip = [len(s) <= 1 for s in shapes]
    expected = reference_lars(
        weights, grads, lr=lr, momentum=momentum, wd=wd, eta=eta, eps=eps, skip=skip
    )
    for p, e in zip(params, expected):
        np.testing.assert_allclose(
            p.detach().numpy(), e, rtol=2e-5, atol=2e-5 * (1 + np.abs(e).max())
        )


def test_zero_norms_give_trust_one():
    w = [torch.zeros(3, 3), torch.ones(3, 3), torch.zeros(2, 2), torch.full((2, 2), 2.0)]
    g = [torch.ones(3, 3), torch.zeros(3, 3), torch.zeros(2, 2), torch.full((2, 2), 8.0)]
    t = trust_ratios(w, g, trust_coefficient=0.5)
    assert [x.item() for x in t] == [1.0, 1.0, 1.0, 0.5 * 4.0 / 16.0]


def test_excluded_parameters_get_plain_momentum_sgd_without_weight_decay():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = LARS(model.parameters(), lr=0.1, momentum=0.0, weight_decay=0.5, trust_coefficient=0.01)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(8, 3)).pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    for name, p in model.named_parameters():
        if p.dim() <= 1:  # bias, BN weight and bias: w - lr * g exactly
            torch.testing.assert_close(p.detach(), before[name] - 0.1 * grads[name])
        else:  # the weight matrix: lr * trust * (g + wd w), trust = eta |w| / (|g| + wd |w|)
            w, g = before[name].double(), grads[name].double()
            trust = 0.01 * w.norm() / (g.norm() + 0.5 * w.norm())
            expected = w - 0.1 * trust * (g + 0.5 * w)
            torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-7)
            assert not torch.allclose(expected, w - 0.1 * g)  # really not the plain rule


def test_group_override_and_exclude_none():
    w = torch.nn.Parameter(torch.ones(4))  # dim 1: excluded by default
    opt = LARS(
        [{"params": [w], "lars_skip": False}],
        lr=1.0,
        momentum=0.0,
        weight_decay=0.0,
        trust_coefficient=0.5,
    )
    w.grad = torch.full((4,), 4.0)  # trust = 0.5 * 2 / 8
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((4,), 1.0 - 0.125 * 4.0))
    m = torch.nn.Parameter(torch.ones(2, 2))
    opt = LARS([m], lr=1.0, momentum=0.0, weight_decay=0.0, exclude=None, trust_coefficient=0.5)
    m.grad = torch.full((2, 2), 4.0)
    opt.step()
    torch.testing.assert_close(m.detach(), torch.full((2, 2), 0.5))


def test_step_never_reads_back_to_host(monkeypatch):
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)
    )
    opt = LARS(model.parameters(), lr=0.1)
    wrapped = lars(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
        0.01,
        clip=True,
    )
    model(torch.randn(4, 5)).sum().backward()

    def sync(*_a, **_k):
        raise AssertionError("host synchronisation inside step()")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    opt.step()
    opt.step()
    wrapped.step()
    monkeypatch.undo()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skips_params_without_grad_and_rejects_sparse():
    a, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2, 2))
    opt = LARS([a, b], lr=0.1)
    a.grad = torch.ones(2, 2)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2, 2)) and not torch.equal(
        a.detach(), torch.ones(2, 2)
    )
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = LARS(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=-1.0),
        dict(lr=0.1, momentum=-0.1),
        dict(lr=0.1, weight_decay=-1.0),
        dict(lr=0.1, trust_coefficient=0.0),
        dict(lr=0.1, eps=-1.0),
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="LARS"):
        LARS([torch.nn.Parameter(torch.ones(2, 2))], **kwargs)


def _train(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()


def _problem(seed=0, steps=4):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (3,), (2, 2, 3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return params, grads


def test_state_dict_round_trip_continues_identically():
    params, grads = _problem()
    opt = LARS(params, lr=0.5, weight_decay=1e-3, trust_coefficient=0.02)
    _train(opt, params, grads[:2])
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    _train(opt, params, grads[2:])
    params2 = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = LARS(params2, lr=0.5, weight_decay=1e-3, trust_coefficient=0.02)
    opt2.load_state_dict(saved_state)
    _train(opt2, params2, grads[2:])
    for p, q in zip(params, params2):
        assert torch.equal(p, q)


def test_wrapper_scale_mode_equals_lars_with_constant_lr():
    params, grads = _problem(seed=1)
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = LARS(params, lr=0.3, momentum=0.9, weight_decay=1e-2, trust_coefficient=0.05)
    wrapped = lars(torch.optim.SGD(params2, lr=0.3, momentum=0.9, weight_decay=1e-2), 0.05)
    _train(ref, params, grads)
    _train(wrapped, params2, grads)
    for p, q in zip(params, params2):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert wrapped.param_groups[0]["weight_decay"] == 1e-2  # restored after each step


def test_wrapper_clip_mode_caps_the_step_at_the_trust_ratio():
    w = torch.nn.Parameter(torch.full((2, 2), 1.0))  # ||w|| = 2
    big = lars(torch.optim.SGD([w], lr=1.0), trust_coefficient=0.5, clip=True)
    w.grad = torch.full((2, 2), 4.0)  # trust = 0.5*2/8 = 0.125 < lr = 1: step size 0.125
    big.step()
    torch.testing.assert_close(w.detach(), torch.full((2, 2), 1.0 - 0.125 * 4.0))
    v = torch.nn.Parameter(torch.full((2, 2), 1.0))
    small = lars(torch.optim.SGD([v], lr=0.01), trust_coefficient=0.5, clip=True)
    v.grad = torch.full((2, 2), 4.0)  # trust 0.125 > lr 0.01: plain SGD step
    small.step()
    torch.testing.assert_close(v.detach(), torch.full((2, 2), 1.0 - 0.01 * 4.0))


def test_wrapper_excludes_bias_from_adaptation_and_weight_decay():
    b = torch.nn.Parameter(torch.ones(3))
    opt = lars(torch.optim.SGD([b], lr=0.1, weight_decay=0.5), trust_coefficient=1e-3)
    b.grad = torch.full((3,), 2.0)
    opt.step()
    torch.testing.assert_close(b.detach(), torch.full((3,), 1.0 - 0.1 * 2.0))
    assert exclude_bias_and_norm(b) and not exclude_bias_and_norm(torch.ones(2, 2))


def test_wrapper_works_with_adam_lr_scheduler_grad_scaler_and_checkpoints():
    from commopt.optim.lr_schedules import PolyWarmup

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = lars(torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4), 0.02)
    sched = PolyWarmup(opt, total_steps=10, warmup_steps=2, end_lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * (1 - 4 / 8) ** 2)
    state = opt.state_dict()
    assert len(state["state"]) == 4 and "exp_avg" in state["state"][0]
    opt.load_state_dict(state)
    assert "lars(" in repr(opt)


def test_lars_is_callable_from_the_package():
    import commopt.optim
    import commopt.optim.layerwise  # importing the module must not hide the function
    from commopt.optim import lars as from_package

    assert callable(from_package) and from_package is commopt.optim.layerwise.lars

    opt = from_package(torch.optim.SGD([torch.nn.Parameter(torch.ones(2, 2))], lr=0.1), 0.01)
    assert type(opt).__name__ == "LayerwiseAdaptation"
    assert isinstance(commopt.optim.LARS([torch.nn.Parameter(torch.ones(2))], lr=0.1), LARS)
