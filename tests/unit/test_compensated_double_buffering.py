"""``double_buffering="compensated"`` in the wrapper, on one rank (``local`` communicator).

With one rank the local gradient is the average, so the wrapper must do exactly what
:class:`~commopt.optim.staleness.LocalStepPrediction`'s contract does by hand, and land
where synchronous training does. Multi-rank behaviour: tests/distributed/test_compensated.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import commopt
from commopt.optim.layerwise import LARS
from tests.staleness_loop import compensated_by_hand

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "lars": lambda ps: LARS(ps, lr=0.5, momentum=0.9, trust_coefficient=0.02),
}


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model, step):
    g = torch.Generator().manual_seed(1000 * step)
    x = torch.randn(16, 6, generator=g)
    return nn.functional.mse_loss(model(x), (x[:, :3] * 2.0).sin())


def _wrapped(name, seed=0, **kw):
    model = _model(seed)
    # Every tensor compensated (the contract's loop); the default rule's synchronous 1-D
    # tensors are tested in test_per_group_plans.py.
    kw.setdefault("synchronous_vectors", False)
    opt = commopt.create_multi_node_optimizer(
        OPTIMIZERS[name](model.parameters()),
        commopt.create_communicator("local"),
        model=model,
        double_buffering="compensated",
        **kw,
    )
    return model, opt


def _train(model, opt, steps, set_to_none=True):
    for step in steps:
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def _by_hand(name, steps):
    """The contract of staleness.py, written out (the delayed loop with prediction)."""
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())

    def grads(step):
        for p in model.parameters():
            p.grad = None
        _loss(model, step).backward()
        return [p.grad.clone() for p in model.parameters()]

    compensated_by_hand(model, opt, grads, steps)
    return model


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("set_to_none", [True, False])  # False: gradients are bucket views
def test_wrapper_does_exactly_what_the_contract_does(name, set_to_none):
    model, opt = _wrapped(name)
    _train(model, opt, range(8), set_to_none)
    opt.flush()
    for a, b in zip(_by_hand(name, 8).parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_rank_follows_synchronous_training_where_plain_lags(name):
    sync = _model()
    sync_opt = OPTIMIZERS[name](sync.parameters())
    for step in range(12):
        sync_opt.zero_grad()
        _loss(sync, step).backward()
        sync_opt.step()
    model, opt = _wrapped(name)
    _train(model, opt, range(12))
    opt.flush()
    for a, b in zip(sync.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    plain = _model()
    popt = commopt.create_multi_node_optimizer(
        OPTIMIZERS[name](plain.parameters()),
        commopt.create_communicator("local"),
        double_buffering="stale",
    )
    _train(plain, popt, range(12))
    popt.flush()
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(sync.parameters(), plain.parameters()))


def test_true_weights_flush_and_repr():
    model, opt = _wrapped("adamw")
    _train(model, opt, range(3))
    predicted = [p.detach().clone() for p in model.parameters()]
    with opt.true_weights():
        true = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"inside `with optimizer\.true_weights"):
            opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(predicted, true))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), predicted))
    assert "double_buffering=compensated" in repr(opt)
    assert opt.wire_settings["double_buffering"] == "'compensated'"
    opt.flush()  # applies the last average at the true weights; the model keeps them
    with opt.true_weights():
        after = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after))


@pytest.mark.parametrize("kwargs", [{}, {"compression": "qsgd4+ef", "clip_grad_norm": 0.5}])
def test_state_dict_resume_is_bit_exact(kwargs):
    model, opt = _wrapped("adamw", **kwargs)
    _train(model, opt, range(4))
    sd = copy.deepcopy(opt.state_dict())  # torch's state dict holds live state tensors
    (part,) = sd["commopt"]["plans"].values()
    assert part["compensated"]["weights"] is not None
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}  # predicted weights
    _train(model, opt, range(4, 8))
    opt.flush()

    model2, opt2 = _wrapped("adamw", seed=5, **kwargs)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(sd)
    _train(model2, opt2, range(4, 8))
    opt2.flush()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_after_flush_loads_into_any_double_buffering_mode(tmp_path):
    from commopt.optim import load_checkpoint, save_checkpoint

    model, opt = _wrapped("sgd", compression="qsgd4+ef")
    _train(model, opt, range(3))
    opt.flush()
    opt.zero_grad()  # flush() leaves the last average in .grad
    (part,) = opt.state_dict()["commopt"]["plans"].values()
    assert part["compensated"]["weights"] is None
    save_checkpoint(tmp_path / "ck", model, opt)
    _train(model, opt, range(3, 6))
    opt.flush()
    for mode in ("compensated", "stale"):
        model2 = _model(3)
        opt2 = commopt.create_multi_node_optimizer(
            OPTIMIZERS["sgd"](model2.parameters()),
            commopt.create_communicator("local"),
            model=model2,
            double_buffering=mode,
            compression="qsgd4+ef",
            synchronous_vectors=False,  # as saved
        )
        load_checkpoint(tmp_path / "ck", model2, opt2)
        _train(model2, opt2, range(3, 6))
        opt2.flush()
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
        assert same == (mode == "compensated"), mode


def test_a_checkpoint_of_other_default_rule_settings_is_refused_with_the_fix(tmp_path):
    from commopt.optim import load_checkpoint, save_checkpoint

    model, opt = _wrapped("sgd", compression="qsgd4+ef")  # every tensor compensated
    _train(model, opt, range(2))
    save_checkpoint(tmp_path / "ck", model, opt)
    model2, opt2 = _wrapped("sgd", compression="qsgd4+ef", synchronous_vectors=True)
    with pytest.raises(ValueError, match="synchronous_vectors= as when it was saved"):
        load_checkpoint(tmp_path / "ck", model2, opt2)


def test_checkpoint_files_save_true_weights_and_resume_exactly(tmp_path):
    from commopt.optim import load_checkpoint, save_checkpoint

    model, opt = _wrapped("sgd", compression="qsgd4+ef")
    _train(model, opt, range(3))
    with opt.true_weights():
        true = {k: v.clone() for k, v in model.state_dict().items()}
    save_checkpoint(tmp_path / "ck", model, opt)
    _train(model, opt, range(3, 6))
    opt.flush()
    model2, opt2 = _wrapped("sgd", seed=3, compression="qsgd4+ef")
    load_checkpoint(tmp_path / "ck", model2, opt2)
    from commopt.optim.checkpoint_files import _read

    saved = _read(tmp_path / "ck" / "replicated")["model"]
    assert all(torch.equal(saved[k], true[k]) for k in true)  # the model file: true weights
    _train(model2, opt2, range(3, 6))
    opt2.flush()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_no_sync_accumulation_and_nonfinite_skip():
    model, opt = _wrapped("sgd")
    with opt.no_sync():
        _loss(model, 0).backward()
    _loss(model, 1).backward()
    opt.step()
    opt.zero_grad()
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    opt.step()  # NaN here: no local step is predicted from it
    opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _loss(model, 2).backward()
    opt.step()
    opt.zero_grad()
    opt.flush()
    assert opt.skipped_steps == 1 and opt.applied_steps == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_errors_name_the_fix():
    model = _model()
    with pytest.raises(TypeError, match="double_buffering='stale'"):
        commopt.create_multi_node_optimizer(
            torch.optim.RMSprop(model.parameters()),
            commopt.create_communicator("local"),
            double_buffering="compensated",
        )
    with pytest.raises(ValueError, match="'compensated'"):
        commopt.create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            commopt.create_communicator("local"),
            double_buffering="compensate",
        )
    m, opt = _wrapped("sgd")
    _train(m, opt, range(2))
    sd = opt.state_dict()
    plain = commopt.create_multi_node_optimizer(
        torch.optim.SGD(_model().parameters(), lr=0.1),
        commopt.create_communicator("local"),
        double_buffering="stale",
    )
    with pytest.raises(ValueError, match="double_buffering='compensated'"):
        plain.load_state_dict(sd)


def test_grad_scaler_and_horovod_clipping_pattern_match_the_plain_loop():
    # A power-of-two scale unscales exactly: the same weights as without GradScaler.
    ref, ropt = _wrapped("adamw", clip_grad_norm=0.3)
    _train(ref, ropt, range(5))
    ropt.flush()
    model, opt = _wrapped("adamw", clip_grad_norm=0.3)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=10_000)
    for step in range(5):
        scaler.scale(_loss(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    opt.flush()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # synchronize() sends (and takes the local gradients); the clip sees the average.
    hv, hopt = _wrapped("adamw")
    for step in range(5):
        _loss(hv, step).backward()
        hopt.synchronize()
        torch.nn.utils.clip_grad_norm_(hv.parameters(), 0.3)  # the average step() applies
        with hopt.skip_synchronize():
            hopt.step()
        hopt.zero_grad()
    hopt.flush()
    assert hopt.applied_steps == 5 and all(torch.isfinite(p).all() for p in hv.parameters())
