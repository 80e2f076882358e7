"""Error feedback: the residual, its effect over steps, its state and its failure modes."""

from __future__ import annotations

import io

import pytest
import torch

from commopt.codecs import QSGD, ErrorFeedback, RngKey, get_codec


def _send(codec, x, key="b0", step=0, scale=1.0):
    wire = torch.empty(codec.encoded_nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, wire, scale=scale, rng=RngKey(seed=1, rank=0, reduction=step), key=key)
    out = torch.empty(x.numel())
    codec.decode(wire, out)
    return wire, out


def test_residual_is_input_minus_what_was_sent_exactly():
    ef = get_codec("qsgd4+ef")
    x = torch.randn(1000)
    _, sent = _send(ef, x, scale=0.5)
    assert torch.equal(ef.residual("b0"), x * 0.5 - sent)
    y = torch.randn(1000)
    before = ef.residual("b0").clone()
    _, sent2 = _send(ef, y, step=1, scale=0.5)
    assert torch.allclose(ef.residual("b0"), (before + y * 0.5) - sent2, atol=1e-6)


def test_errors_cancel_over_steps():
    # Without feedback a deterministic quantiser repeats the same error forever; with it the
    # average of what was sent converges to the input (|mean - x| <= |residual| / T).
    x = torch.randn(512) * 0.01
    x[::128] = 1.0  # one large value per bucket makes the others round to zero
    plain, ef = QSGD(2, 128, stochastic=False), ErrorFeedback(QSGD(2, 128, stochastic=False))
    steps = 200
    total_plain, total_ef = torch.zeros(512), torch.zeros(512)
    for t in range(steps):
        total_plain += _send(plain, x, step=t)[1]
        total_ef += _send(ef, x, step=t)[1]
    err_plain = (total_plain / steps - x).abs().max().item()
    err_ef = (total_ef / steps - x).abs().max().item()
    assert err_plain > 0.005
    assert err_ef <= ef.residual("b0").abs().max().item() / steps + 1e-6
    assert err_ef < err_plain / 10


def test_keys_are_separate_and_sizes_checked():
    ef = get_codec("qsgd8+ef")
    _send(ef, torch.randn(300), key=("bucket", 0))
    _send(ef, torch.randn(50), key=("bucket", 1))
    assert ef.residual(("bucket", 0)).numel() == 300 and ef.residual(("bucket", 1)).numel() == 50
    with pytest.raises(ValueError, match="own key"):
        _send(ef, torch.randn(51), key=("bucket", 1))
    ef.reset(("bucket", 1))
    assert ef.residual(("bucket", 1)) is None and ef.residual(("bucket", 0)) is not None
    ef.reset()
    assert ef.state_dict() == {"residuals": {}}


def test_state_dict_restores_the_run_exactly():
    a = get_codec("qsgd4+ef")
    xs = [torch.randn(700) for _ in range(6)]
    for t in range(3):
        _send(a, xs[t], key=t % 2, step=t)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = get_codec("qsgd4+ef")
    b.load_state_dict(torch.load(buf))
    for t in range(3, 6):
        wa, _ = _send(a, xs[t], key=t % 2, step=t)
        wb, _ = _send(b, xs[t], key=t % 2, step=t)
        assert torch.equal(wa, wb)
    with pytest.raises(ValueError, match="unexpected"):
        b.load_state_dict({"residual": {}})
    with pytest.raises(TypeError, match="float32"):
        b.load_state_dict({"residuals": {0: torch.zeros(3, dtype=torch.int64)}})


def test_non_finite_input_is_sent_but_not_carried():
    ef = get_codec("qsgd4+ef")
    x = torch.randn(256)
    x[3] = float("nan")
    _, sent = _send(ef, x)
    assert bool(torch.isnan(sent[:128]).all())  # the optimizer's check sees it
    assert bool(torch.isfinite(ef.residual("b0")).all())
    _, sent = _send(ef, torch.randn(256), step=1)
    assert bool(torch.isfinite(sent).all()), "one bad step must not poison the next"


def test_wrapper_exposes_inner_and_its_traits():
    ef = get_codec("fp16+ef")
    assert ef.inner.name == "fp16" and ef.name == "fp16+ef"
    assert ef.linear and ef.wire_dtype == torch.float16
    q = get_codec("qsgd4+ef")
    assert not q.linear and q.alignment == 128 and q.stochastic and q.inner.bits == 4
    with pytest.raises(ValueError, match="once"):
        ErrorFeedback(q)
    with pytest.raises(TypeError):
        ErrorFeedback("qsgd4")


def test_a_discarded_step_leaves_the_residuals_bit_identical():
    torch.manual_seed(0)
    steps = [torch.randn(256) for _ in range(4)]
    ref = get_codec("qsgd4+ef")  # the bad step (index 2) never happens
    for i, x in enumerate(s for j, s in enumerate(steps) if j != 2):
        ref.begin_step()
        _send(ref, x, step=i)
    ef = get_codec("qsgd4+ef")
    i = 0
    for j, x in enumerate(steps):
        ef.begin_step()
        _send(ef, x, step=i, scale=0.5 if j == 2 else 1.0)
        _send(ef, x, key="new" if j == 2 else "b1", step=i)  # a key first seen in the bad step
        if j == 2:
            ef.discard_step()
            continue
        i += 1
    assert torch.equal(ef.residual("b0"), ref.residual("b0"))
    assert ef.residual("new") is None


def test_without_begin_step_encode_updates_in_place():
    ef = get_codec("qsgd4+ef")
    _send(ef, torch.randn(256))
    r = ef.residual("b0")
    _send(ef, torch.randn(256), step=1)
    assert ef.residual("b0") is r and not ef._spare  # no second buffer unless steps are undoable
