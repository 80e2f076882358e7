"""The low-rank codec (PowerSGD): its contract, checked on several simulated ranks.

The ranks are codec instances in one process: each runs the codec's stages, and the sums
between them (what the two allreduces deliver) are formed here in rank order. The real
transports are exercised in tests/distributed/test_powersgd.py.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import commopt
from commopt import collectives
from commopt.codecs import ErrorFeedback, PowerSGD, RngKey, codec_names, get_codec
from commopt.codecs.lowrank import orthogonalize_

SETTINGS = settings(max_examples=40, deadline=None)


def reduce_once(codecs, xs, shapes, *, key="b0", step=None, average=True):
    """One reduction of ``xs`` (one flat buffer per rank); returns each rank's result."""
    n = len(codecs)
    flats = [x.clone() for x in xs]
    factor = 1.0 / n if average else 1.0
    jobs = [
        c.start(f, shapes, key=key, factor=factor, size=n, reduction=step)
        for c, f in zip(codecs, flats)
    ]
    p_sum = jobs[0].p.clone()
    for j in jobs[1:]:
        p_sum += j.p
    for j in jobs:
        j.p.copy_(p_sum)
    qs = [j.after_p_sum() for j in jobs]
    q_sum = qs[0].clone()
    for q in qs[1:]:
        q_sum += q
    for q in qs:
        q.copy_(q_sum)
    for j in jobs:
        j.after_q_sum()
    return flats


@st.composite
def low_rank_case(draw):
    """(rows, cols, codec rank, per-rank matrices whose mean has rank <= codec rank)."""
    rows = draw(st.integers(1, 12))
    cols = draw(st.integers(1, 12))
    rank = draw(st.integers(1, 5))
    k = draw(st.integers(1, min(rank, rows, cols)))
    ranks = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    u = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    # Every rank's matrix shares the column space of u: their mean has rank <= k.
    ms = [
        (u @ torch.randn(k, cols, generator=gen, dtype=torch.float64)) * scale for _ in range(ranks)
    ]
    return rows, cols, rank, ms


@SETTINGS
@given(low_rank_case(), st.booleans())
def test_a_rank_r_input_is_reproduced(case, ef):
    """From the second step on: the first starts from a random Q, as accurate as that Q
    is aligned with the input's rows (PowerSGD's single power iteration per step); warm
    start then holds a Q inside the input's row space."""
    rows, cols, rank, ms = case
    mean = sum(ms) / len(ms)
    s = torch.linalg.svdvals(mean)
    k = int((s > 1e-9 * s[0]).sum()) if s[0] > 0 else 0
    assume(k > 0 and s[k - 1] > 0.1 * s[0])  # a well-conditioned rank-k mean
    n = len(ms)
    codecs = [PowerSGD(rank, error_feedback=ef, min_compression_rate=0.0, seed=3) for _ in ms]
    xs = [m.float().reshape(-1) for m in ms]
    first = reduce_once(codecs, xs, [(0, (rows, cols))], step=0)
    assert all(torch.isfinite(o).all() and torch.equal(o, first[0]) for o in first)
    before = [c.residual("b0") for c in codecs]
    outs = reduce_once(codecs, xs, [(0, (rows, cols))], step=1)
    # the sum of the contributions: the mean, plus the residuals carried from step 0
    want = mean.float().reshape(-1)
    if ef:
        want = want + sum(before)
    tol = 1e-3 * float(want.norm()) + 1e-30
    for i, out in enumerate(outs):
        assert (out - want).norm() <= tol, f"rank {i}: {(out - want).norm()} > {tol}"
        assert torch.equal(out, outs[0]), f"rank {i} differs from rank 0"
        if ef:
            # residual = own contribution - own share of the result
            expect = xs[i] / n + before[i] - out / n
            assert torch.allclose(codecs[i].residual("b0"), expect, atol=tol), f"rank {i}"


def test_a_rank_deficient_input_with_a_larger_rank_is_reproduced():
    # Rank 1 in a rank-3 codec: the two extra columns of P are combinations of the first
    # (up to rounding); they become zero instead of noise that is not orthogonal to it.
    gen = torch.Generator().manual_seed(1194)
    u = torch.randn(3, 1, generator=gen, dtype=torch.float64)
    m = ((u @ torch.randn(1, 4, generator=gen, dtype=torch.float64)) * 1e-3).float()
    codec = PowerSGD(3, error_feedback=False, min_compression_rate=0.0)
    (out,) = reduce_once([codec], [m.reshape(-1)], [(0, (3, 4))])
    assert (out - m.reshape(-1)).norm() <= 1e-5 * m.norm()


@st.composite
def buffers(draw):
    """A flat buffer of several tensors (matrices, convolutions, vectors, degenerate ones)."""
    shapes = draw(
        st.lists(
            st.sampled_from(
                [(7, 9), (1, 20), (20, 1), (3, 2, 2, 2), (5,), (), (16, 16), (2, 3), (0, 4)]
            ),
            min_size=1,
            max_size=5,
        )
    )
    gap = draw(st.integers(0, 3))
    placed, at = [], 0
    for shape in shapes:
        placed.append((at, shape))
        at += math.prod(shape) + gap
    ranks = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["random", "random", "zeros", "mixed"]))
    xs = []
    for _ in range(ranks):
        x = torch.randn(at, generator=gen)
        if kind == "zeros":
            x.zero_()
        elif kind == "mixed":
            x[: at // 2] = 0.0
        xs.append(x)
    return placed, xs


@SETTINGS
@given(buffers(), st.integers(1, 4), st.sampled_from([0.0, 1.0, 2.0]), st.booleans())
def test_error_feedback_bookkeeping_and_agreement(case, rank, rate, average):
    """Over two steps: nothing is lost (sum of contributions = result + new residuals),
    every rank gets the same bits, exact ranges are exact, nothing is NaN."""
    placed, xs = case
    n = len(xs)
    codecs = [PowerSGD(rank, min_compression_rate=rate, seed=5) for _ in xs]
    lay = codecs[0].placement(xs[0].numel(), placed)
    factor = 1.0 / n if average else 1.0
    for step in range(2):
        inputs = [x * (step + 1) for x in xs]
        before = [c.residual("b0") for c in codecs]
        outs = reduce_once(codecs, inputs, placed, step=step, average=average)
        contributed = sum(
            x * factor + (b if b is not None else 0.0) for x, b in zip(inputs, before)
        )
        residuals = [c.residual("b0") for c in codecs]
        for i, out in enumerate(outs):
            assert torch.isfinite(out).all(), f"rank {i}: non-finite result"
            assert torch.equal(out, outs[0]), f"rank {i} differs from rank 0"
            # this rank's residual: its contribution minus its share of the result
            own = inputs[i] * factor + (before[i] if before[i] is not None else 0.0)
            want = own - out / n
            for lo, hi in lay.rest:
                want[lo:hi] = 0.0
            assert torch.allclose(residuals[i], want, atol=1e-5), f"rank {i}"
        total = outs[0] + sum(residuals)
        assert torch.allclose(total, contributed, atol=1e-4), "the residuals lost something"
        for lo, hi in lay.rest:
            exact = sum(x[lo:hi] for x in inputs) * factor
            assert torch.allclose(outs[0][lo:hi], exact, atol=1e-6)


def test_degenerate_shapes_with_compression_forced_are_exact():
    # 1xN, Nx1 and rank > min(rows, cols): the effective rank is min(rank, rows, cols), so
    # the matrix is reproduced exactly.
    for shape in [(1, 30), (30, 1), (3, 40), (40, 3)]:
        codec = PowerSGD(8, min_compression_rate=0.0)
        x = torch.randn(math.prod(shape))
        (out,) = reduce_once([codec], [x], [(0, shape)])
        assert torch.allclose(out, x, atol=1e-5), shape
        assert codec.placement(x.numel(), [(0, shape)]).matrices, f"{shape} was not compressed"


def test_zero_gradient_then_gradient_comes_back():
    # A layer whose gradient is zero in a step must not stay silent for ever: the zero Q
    # columns are refilled from the bucket's first Q.
    codec = PowerSGD(2, min_compression_rate=0.0)
    shape = (6, 5)
    (out,) = reduce_once([codec], [torch.zeros(30)], [(0, shape)], step=0)
    assert torch.equal(out, torch.zeros(30))
    assert torch.equal(codec.q("b0"), torch.zeros(10))
    assert torch.equal(codec.residual("b0"), torch.zeros(30))
    m = torch.outer(torch.arange(1.0, 7.0), torch.arange(-2.0, 3.0)).reshape(-1)
    (out,) = reduce_once([codec], [m], [(0, shape)], step=1)
    assert torch.allclose(out, m, atol=1e-4)


def test_nan_does_not_poison_the_state():
    codec = PowerSGD(1, min_compression_rate=0.0)
    x = torch.randn(20)
    reduce_once([codec], [x], [(0, (4, 5))], step=0)
    bad = x.clone()
    bad[3] = float("nan")
    (out,) = reduce_once([codec], [bad], [(0, (4, 5))], step=1)
    assert not torch.isfinite(out).all()
    assert torch.isfinite(codec.q("b0")).all() and torch.isfinite(codec.residual("b0")).all()
    (out,) = reduce_once([codec], [x], [(0, (4, 5))], step=2)
    assert torch.isfinite(out).all()


def test_discard_step_restores_q_and_residual_exactly():
    codec = PowerSGD(2, min_compression_rate=0.0)
    shapes = [(0, (8, 6)), (48, (6, 6))]
    x = torch.randn(84)
    reduce_once([codec], [x], shapes, key="a", step=0)
    reduce_once([codec], [x], shapes, key="b", step=0)
    saved = {k: v.clone() for k, v in codec.state_dict()["qs"].items()}
    res = {k: v.clone() for k, v in codec.state_dict()["residuals"].items()}
    reduce_once([codec], [x * 3], shapes, key="a", step=1)
    reduce_once([codec], [x * 3], shapes, key="b", step=1)
    codec.discard_step()
    for k in ("a", "b"):
        assert torch.equal(codec.q(k), saved[k]) and torch.equal(codec.residual(k), res[k])
    # A key first seen in the discarded step is forgotten.
    reduce_once([codec], [x], shapes, key="new", step=1)
    codec.discard_step()
    assert codec.q("new") is None and codec.residual("new") is None


def test_state_round_trip_is_exact():
    a = PowerSGD(4, min_compression_rate=0.0, seed=9)
    shapes = [(0, (16, 12)), (192, (12,)), (204, (4, 3, 3, 3))]
    xs = [torch.randn(312) for _ in range(3)]
    reduce_once([a], [xs[0]], shapes, step=0)
    reduce_once([a], [xs[1]], shapes, step=1)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = PowerSGD(4, min_compression_rate=0.0, seed=9)
    b.load_state_dict(torch.load(buf))
    (out_a,) = reduce_once([a], [xs[2]], shapes, step=2)
    (out_b,) = reduce_once([b], [xs[2]], shapes, step=2)
    assert torch.equal(out_a, out_b)
    assert torch.equal(a.q("b0"), b.q("b0")) and torch.equal(a.residual("b0"), b.residual("b0"))


def test_same_seed_same_first_q_on_every_rank_and_key_dependent():
    shapes = [(0, (10, 10))]
    x = torch.randn(100)
    outs = [reduce_once([PowerSGD(1, seed=4)], [x], shapes, key="k")[0] for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    other = reduce_once([PowerSGD(1, seed=5)], [x], shapes, key="k")[0]
    assert not torch.equal(outs[0], other)


def test_orthogonalize_is_orthonormal_or_zero():
    close = torch.randn(50, 1).repeat(1, 3) + 1e-3 * torch.randn(50, 3)  # nearly dependent
    orthogonalize_(close)
    assert torch.allclose(close.T @ close, torch.eye(3), atol=1e-4)
    tiny = torch.randn(20, 3) * 1e-30  # lengths whose squares underflow float32
    orthogonalize_(tiny)
    assert torch.allclose(tiny.T @ tiny, torch.eye(3), atol=1e-5)
    same = torch.randn(30, 1).repeat(1, 3)  # exactly dependent: one column, two zeros
    orthogonalize_(same)
    assert torch.allclose(same[:, 0].norm(), torch.tensor(1.0))
    assert torch.equal(same[:, 1:], torch.zeros(30, 2))
    z = torch.zeros(7, 2)
    orthogonalize_(z)
    assert torch.equal(z, torch.zeros(7, 2))


def test_names_and_refusals():
    assert {"powersgd1", "powersgd4"} <= set(codec_names())
    codec = get_codec("powersgd4")
    assert isinstance(codec, PowerSGD) and codec.rank == 4 and codec.error_feedback
    with pytest.raises(ValueError, match="own error feedback"):
        get_codec("powersgd4+ef")
    with pytest.raises(ValueError, match="own error feedback"):
        ErrorFeedback(PowerSGD(2))
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(0)
    with pytest.raises(TypeError, match="whole matrices"):
        codec.encoded_nbytes(10)
    with pytest.raises(ValueError, match="overlaps"):
        codec.placement(10, [(0, (3, 3)), (5, (2, 2))])
    comm = commopt.create_communicator("local")
    with pytest.raises(ValueError, match="needs their shapes"):
        collectives.allreduce(comm, torch.ones(8), codec, algorithm="lowrank")
    with pytest.raises(ValueError, match="own plan"):
        collectives.allreduce(comm, torch.ones(8), codec, algorithm="scatter_reduce")
    with pytest.raises(ValueError, match="not one"):
        collectives.allreduce(comm, torch.ones(8), get_codec("qsgd4"), algorithm="lowrank")


def test_allreduce_plan_on_one_rank():
    comm = commopt.create_communicator("local")
    codec = PowerSGD(2, min_compression_rate=0.0)
    m = torch.outer(torch.arange(1.0, 9.0), torch.arange(1.0, 7.0)).reshape(-1)
    v = torch.arange(5.0)
    flat = torch.cat([m, v])
    collectives.allreduce(
        comm, flat, codec, algorithm="lowrank", shapes=[(0, (8, 6)), (48, (5,))], key="k"
    )
    assert torch.allclose(flat[:48], m, atol=1e-4) and torch.equal(flat[48:], v)
    assert codec.q("k") is not None and codec.residual("k").abs().max() < 1e-4


def test_warm_up_names_and_refusals():
    codec = get_codec("powersgd4-start100")
    assert isinstance(codec, PowerSGD) and (codec.rank, codec.start_iter) == (4, 100)
    assert codec.name == "powersgd4-start100" and repr(codec) == "PowerSGD(rank=4, start_iter=100)"
    assert get_codec("powersgd2-start0").start_iter == 0
    with pytest.raises(ValueError, match="number of reductions"):
        get_codec("powersgd4-startx")
    with pytest.raises(ValueError, match="own error feedback"):
        get_codec("powersgd4-start10+ef")
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("qsgd4-start10")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="start_iter"):
            PowerSGD(2, start_iter=bad)
    comm = commopt.create_communicator("local")
    with pytest.raises(ValueError, match="reduction's number"):
        collectives.allreduce(
            comm, torch.ones(48), codec, algorithm="lowrank", shapes=[(0, (8, 6))], key="k"
        )


def test_warm_up_reductions_are_exact_and_leave_the_state_alone():
    """Reductions numbered below start_iter are plain sums; compression starts at start_iter
    from the first Q and a zero residual, as a codec without warm-up starts at reduction 0."""
    comm = commopt.create_communicator("local")
    warm, cold = PowerSGD(1, start_iter=2), PowerSGD(1)
    gen = torch.Generator().manual_seed(3)
    shapes = [(0, (16, 12)), (192, (5,))]

    def reduce(codec, flat, step):
        collectives.allreduce(
            comm,
            flat,
            codec,
            algorithm="lowrank",
            shapes=shapes,
            key="k",
            scale=0.5,
            rng=RngKey(0, 0, step),
        )

    for step in range(2):
        x = torch.randn(197, generator=gen)
        flat = x.clone()
        reduce(warm, flat, step)
        assert torch.equal(flat, x * 0.5), f"warm-up reduction {step} was not exact"
        assert warm.q("k") is None and warm.residual("k") is None
        warm.discard_step()  # a skipped warm-up step: nothing to put back
        assert warm.state_dict() == {"qs": {}, "residuals": {}}
    for step in range(2, 5):
        x = torch.randn(197, generator=gen)
        a, b = x.clone(), x.clone()
        reduce(warm, a, step)
        reduce(cold, b, step - 2)
        assert torch.equal(a, b), f"reduction {step} differs from the codec without warm-up"
        assert not torch.equal(a[:192], x[:192] * 0.5), "the matrix was not compressed"
    assert torch.equal(warm.q("k"), cold.q("k"))
    assert torch.equal(warm.residual("k"), cold.residual("k"))
