"""LocalStepPrediction: predicted steps match the optimizers, the contract undoes the delay,
replicas stay identical through a codec, and a resume is exact.

The replicas here are model copies in one process averaging through a codec's encode/decode
(the arithmetic of the reduction), not a transport test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commopt.codecs import RngKey, get_codec
from commopt.optim.layerwise import LARS
from commopt.optim.staleness import LocalStepPrediction, predicted_step
from tests.staleness_loop import compensated_by_hand

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "sgd-nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, dampening=0.0
    ),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "lars": lambda ps: LARS(ps, lr=0.5, momentum=0.9, trust_coefficient=0.02),
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int, replica: int = 0):
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(16, 6, generator=g)
    return x, (x[:, :3] * 2.0).sin()


def _grads(model, step, replica=0):
    for p in model.parameters():
        p.grad = None
    x, y = _batch(step, replica)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_predicted_step_is_the_step_the_optimizer_takes(name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    for step in range(4):  # from empty state (step 0) through warm state
        g = _grads(model, step)
        before = [p.detach().clone() for p in model.parameters()]
        predicted = predicted_step(opt, g)
        opt.step()
        for b, p, s in zip(before, model.parameters(), predicted):
            torch.testing.assert_close(b - p.detach(), s, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd", "adamw", "lars"])
def test_one_replica_compensated_double_buffering_follows_synchronous_training(name):
    # With one replica the local gradient is the average: the prediction is exact, so the
    # compensated delayed loop must land where synchronous training does.
    sync = _model()
    sync_opt = OPTIMIZERS[name](sync.parameters())
    for step in range(12):
        _grads(sync, step)
        sync_opt.step()

    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    compensated_by_hand(model, opt, lambda step: _grads(model, step), 12)
    for a, b in zip(sync.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["sgd", "adamw", "lars"])
def test_prediction_lands_on_the_next_weights_during_a_linear_warm_up(name):
    # One replica: the weights predicted at step s must be the true weights after step s+1,
    # although a scheduler raises the learning rate between the two (from step 1 on: the
    # first prediction has no earlier rate to extrapolate from).
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    comp = LocalStepPrediction(opt)
    pending, predicted = None, None
    for step in range(8):
        for group in opt.param_groups:
            group["lr"] = 0.02 * (step + 1)  # a linear warm-up, set before each step
        local = _grads(model, step)
        if pending is not None:
            for p, a in zip(model.parameters(), pending):
                p.grad = a
            comp.restore()
            opt.step()
            if step >= 2:
                for p, q in zip(model.parameters(), predicted):
                    torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6)
        comp.predict(local)
        predicted = [p.detach().clone() for p in model.parameters()]
        pending = local
    assert comp.state_dict()["last_lrs"] == [pytest.approx(0.16)]


def test_next_lrs_extrapolates_rises_only():
    from commopt.optim.staleness import next_lrs

    opt = OPTIMIZERS["sgd"](_model().parameters())
    opt.param_groups[0]["lr"] = 0.3
    assert next_lrs(opt, [0.2]) == [pytest.approx(0.4)]  # linear warm-up
    assert next_lrs(opt, [0.0]) == [pytest.approx(0.6)]  # at most doubled
    assert next_lrs(opt, [3.0]) == [0.3]  # a step decay is not extrapolated
    assert next_lrs(opt, None) == [0.3]


def test_plain_delay_does_not_follow_synchronous_training():
    # The control for the test above: without the prediction, the same loop is off.
    sync, model = _model(), _model()
    so, mo = OPTIMIZERS["sgd"](sync.parameters()), OPTIMIZERS["sgd"](model.parameters())
    pending = None
    for step in range(12):
        _grads(sync, step)
        so.step()
        local = _grads(model, step)
        if pending is not None:
            for p, a in zip(model.parameters(), pending):
                p.grad = a
            mo.step()
        pending = local
    diff = max((a - b).abs().max().item() for a, b in zip(sync.parameters(), model.parameters()))
    assert diff > 1e-3


class _Replica:
    def __init__(self, name, rank, codec):
        self.rank, self.model = rank, _model()
        self.opt = OPTIMIZERS[name](self.model.parameters())
        self.comp = LocalStepPrediction(self.opt)
        self.codec = get_codec(codec)
        self.pending = None

    def params(self):
        return list(self.model.parameters())


def _train(replicas, steps, start=0):
    """Compensated double buffering over in-process replicas averaging through their codec."""
    n = len(replicas)
    for step in range(start, start + steps):
        flats = []
        for r in replicas:
            local = _grads(r.model, step, r.rank)
            r.local = local
            flat = torch.cat([g.flatten() for g in local])
            wire = torch.empty(r.codec.encoded_nbytes(flat.numel()), dtype=torch.uint8)
            r.codec.encode(flat, wire, scale=1.0 / n, rng=RngKey(7, r.rank, step), key="b")
            flats.append(wire)
        avg = torch.zeros_like(flat)
        for wire in flats:
            replicas[0].codec.decode(wire, avg, accumulate=True)
        for r in replicas:
            if r.pending is not None:
                off = 0
                for p in r.params():
                    p.grad = r.pending[off : off + p.numel()].view_as(p).clone()
                    off += p.numel()
                r.comp.restore()
                r.opt.step()
            r.comp.predict(r.local)
            r.pending = avg.clone()


@pytest.mark.parametrize("codec", ["qsgd4+ef", "fp16"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_replicas_keep_identical_true_weights_and_state_through_a_codec(name, codec):
    replicas = [_Replica(name, rank, codec) for rank in range(2)]
    _train(replicas, 6)
    predicted = [[p.detach().clone() for p in r.params()] for r in replicas]
    assert any(not torch.equal(a, b) for a, b in zip(*predicted)), (
        "each rank predicts from its own gradient"
    )
    for r in replicas:
        r.comp.restore()
    for a, b in zip(replicas[0].params(), replicas[1].params()):
        assert torch.equal(a, b)
    s0, s1 = (r.opt.state_dict()["state"] for r in replicas)
    for k in s0:
        for key in s0[k]:
            assert torch.equal(torch.as_tensor(s0[k][key]), torch.as_tensor(s1[k][key]))


@pytest.mark.parametrize("name", ["sgd", "adamw", "lars"])
def test_resume_from_state_dicts_is_exact(name):
    ref = [_Replica(name, 0, "qsgd4+ef")]
    _train(ref, 5)
    saved = {
        "model": {k: v.clone() for k, v in ref[0].model.state_dict().items()},
        "opt": ref[0].opt.state_dict(),
        "comp": ref[0].comp.state_dict(),
        "codec": ref[0].codec.state_dict(),
        "pending": ref[0].pending.clone(),
    }
    saved = _roundtrip(saved)
    _train(ref, 5, start=5)

    new = [_Replica(name, 0, "qsgd4+ef")]
    new[0].model.load_state_dict(saved["model"])
    new[0].opt.load_state_dict(saved["opt"])
    new[0].comp.load_state_dict(saved["comp"])
    new[0].codec.load_state_dict(saved["codec"])
    new[0].pending = saved["pending"]
    _train(new, 5, start=5)
    for a, b in zip(ref[0].params(), new[0].params()):
        assert torch.equal(a, b)
    for r in ref + new:
        r.comp.restore()
    for a, b in zip(ref[0].params(), new[0].params()):
        assert torch.equal(a, b)


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_true_weights_context_and_state_without_prediction():
    model = _model()
    opt = OPTIMIZERS["sgd"](model.parameters())
    comp = LocalStepPrediction(opt)
    assert comp.state_dict() == {"weights": None, "last_lrs": None} and not comp.predicting
    true = [p.detach().clone() for p in model.parameters()]
    comp.predict(_grads(model, 0))
    predicted = [p.detach().clone() for p in model.parameters()]
    assert comp.predicting and not torch.equal(predicted[0], true[0])
    with comp.true_weights():
        assert all(torch.equal(p, t) for p, t in zip(model.parameters(), true))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), predicted))
    comp.restore()
    comp.restore()  # idempotent
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), true))


def test_errors_say_what_to_do():
    model = _model()
    with pytest.raises(TypeError, match="double_buffering='stale'"):
        LocalStepPrediction(torch.optim.RMSprop(model.parameters()))
    comp = LocalStepPrediction(OPTIMIZERS["sgd"](model.parameters()))
    comp.predict(_grads(model, 0))
    with pytest.raises(RuntimeError, match="restore"):
        comp.predict(_grads(model, 1))
    with pytest.raises(ValueError, match="parameters"):
        predicted_step(comp.optimizer, [None])
    with pytest.raises(ValueError, match="do not match"):
        comp.load_state_dict({"weights": [torch.zeros(1)]})
    with pytest.raises(ValueError, match="state_dict"):
        comp.load_state_dict({"w": None})
