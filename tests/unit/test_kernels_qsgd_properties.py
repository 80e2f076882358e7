"""Properties of the QSGD kernels, for every CPU implementation (reference and native).

Statistical bound used for unbiasedness: each decoded element lies in an interval of width
``step`` around its input, so by Hoeffding's inequality the mean of N independent decodes
is within ``eps * step`` of its expectation except with probability ``2 exp(-2 N eps^2)``.
With N = 200 and eps = 0.3 that is 4.6e-16 per element. The expectation itself is the input
up to the 24-bit resolution of the random numbers (bias < 2^-24 step) and the rounding of
``|v| / step`` (relative 2^-24).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from commopt import kernels
from commopt.kernels import reference as ref
from tests.unit.codec_helpers import CPU_IMPLS, float_tensors, per_element, steps_of

N_DRAWS, EPS = 200, 0.3
configs = st.fixed_dictionaries(
    {
        "bits": st.sampled_from([2, 4, 8]),
        "bucket_size": st.sampled_from([1, 4, 7, 32, 128, 200]),
        "norm": st.sampled_from(["max", "l2"]),
        "scale_bytes": st.sampled_from([4, 2]),
    }
)


def _encode(x, cfg, impl, *, key=(1, 2), stochastic=True, levels=None, scale=1.0):
    bits = cfg["bits"]
    levels = levels or 2 ** (bits - 1) - 1
    wire = torch.empty(
        kernels.qsgd_nbytes(
            x.numel(), bits=bits, bucket_size=cfg["bucket_size"], scale_bytes=cfg["scale_bytes"]
        ),
        dtype=torch.uint8,
    )
    kernels.qsgd_encode(
        x,
        wire,
        bits=bits,
        levels=levels,
        bucket_size=cfg["bucket_size"],
        key=key,
        norm=cfg["norm"],
        stochastic=stochastic,
        scale=scale,
        scale_bytes=cfg["scale_bytes"],
        impl=impl,
    )
    out = torch.empty(x.numel())
    kernels.qsgd_decode(
        wire,
        out,
        bits=bits,
        levels=levels,
        bucket_size=cfg["bucket_size"],
        scale_bytes=cfg["scale_bytes"],
        impl=impl,
    )
    return wire, out


def _fits_half_scales(x, cfg):
    # float16 scales hold steps up to 65504; larger buckets decode as NaN (documented).
    # Likewise an l2 norm must fit in float32: [8e34, 3.4e38] has a norm above its max.
    if not x.numel():
        return True
    if cfg["norm"] == "l2" and x.double().norm().item() >= torch.finfo(torch.float32).max:
        return False
    # And the top level, levels x the step rounded up to cover the norm, must fit in float32:
    # a norm within a rounding of the largest float decodes there as Inf (documented, and
    # tested below).
    norm = x.double().norm().item() if cfg["norm"] == "l2" else x.double().abs().max().item()
    if norm * (1 + 2**-21) >= torch.finfo(torch.float32).max:
        return False
    return cfg["scale_bytes"] == 4 or x.abs().max().item() < 60000


@pytest.mark.parametrize("impl", CPU_IMPLS)
@settings(max_examples=60, deadline=None)
@given(x=float_tensors(max_size=700), cfg=configs, stochastic=st.booleans(), data=st.data())
def test_error_is_within_one_step_and_scale_covers_the_norm(impl, x, cfg, stochastic, data):
    assume(_fits_half_scales(x, cfg))
    levels = data.draw(st.integers(1, 2 ** (cfg["bits"] - 1) - 1))
    wire, out = _encode(x, cfg, impl, stochastic=stochastic, levels=levels)
    n, B = x.numel(), cfg["bucket_size"]
    if n == 0:
        assert wire.numel() == 0
        return
    steps = steps_of(wire, n, B, cfg["scale_bytes"])
    nb = steps.numel()
    padded = torch.nn.functional.pad(x, (0, nb * B - n)).view(nb, B)
    norms = ref.bucket_norm(padded, cfg["norm"]).double()
    assert bool((steps.double() * levels >= norms).all()), "levels * step must cover the norm"
    if cfg["scale_bytes"] == 4:  # rounded up by at most one float32 ulp
        assert bool((steps.double() <= norms / levels * (1 + 2**-22) + 2**-149).all())
    step = per_element(steps, n, B).double()
    err = (out.double() - x.double()).abs()
    bound = step * (1.0 if stochastic else 0.5) * (1 + 2**-20)
    assert bool((err <= bound).all()), (err - bound).max()
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_a_norm_at_the_top_of_float32_decodes_finite_or_as_inf_never_wrong(impl):
    # levels x the rounded-up step exceeds the largest float: the top level decodes as Inf,
    # which the optimizer's NaN/Inf agreement catches; every other value decodes finite.
    top = torch.finfo(torch.float32).max
    x = torch.tensor([top, -top, top / 3, 0.0] * 64)
    cfg = {"bits": 8, "bucket_size": 4, "norm": "max", "scale_bytes": 4}
    _, out = _encode(x, cfg, impl)
    finite = torch.isfinite(out)
    assert bool(finite[2::4].all()) and bool(finite[3::4].all())
    assert bool((out[~finite].abs() == float("inf")).all())  # Inf, never NaN
    assert bool((out[~finite].sign() == x[~finite].sign()).all())
    close = (out[finite].double() - x[finite].double()).abs() <= top / 127 * (1 + 2**-20)
    assert bool(close.all())


@pytest.mark.parametrize("impl", CPU_IMPLS)
@settings(max_examples=12, deadline=None)
@given(x=float_tensors(max_size=160, min_size=1), cfg=configs)
def test_stochastic_rounding_is_unbiased(impl, x, cfg):
    assume(_fits_half_scales(x, cfg))
    n, B = x.numel(), cfg["bucket_size"]
    span = -(-n // B) * B
    # N copies in one encode: every copy draws its own random numbers (the counter is the
    # element index) and has the same buckets, hence the same steps.
    tiled = torch.nn.functional.pad(x, (0, span - n)).repeat(N_DRAWS)
    wire, out = _encode(tiled, cfg, impl)
    mean = out.view(N_DRAWS, span)[:, :n].double().mean(dim=0)
    step = per_element(steps_of(wire, span, B, cfg["scale_bytes"]), n, B).double()
    bound = EPS * step + 2**-22 * (step + x.double().abs())
    assert bool(((mean - x.double()).abs() <= bound).all())


@pytest.mark.parametrize("impl", CPU_IMPLS)
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 600),
    bits=st.sampled_from([2, 4, 8]),
    bucket=st.sampled_from([1, 5, 128, 129]),
    mant=st.integers(1, 2**11 - 1),
    exp=st.integers(-30, 10),
    half=st.booleans(),
    seed=st.integers(0, 999),
)
def test_values_on_levels_round_trip_exactly(impl, n, bits, bucket, mant, exp, half, seed):
    levels = 2 ** (bits - 1) - 1
    step = math.ldexp(mant, exp)  # at most 11 significant bits: q * step is exact
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-levels, levels + 1, (n,), generator=gen)
    q[::bucket] = levels * torch.where(torch.rand(q[::bucket].shape, generator=gen) < 0.5, -1, 1)
    x = (q.double() * step).float()
    cfg = {"bits": bits, "bucket_size": bucket, "norm": "max", "scale_bytes": 2 if half else 4}
    if half:
        assume(2**-24 <= step <= 65504)
        assume((mant < 2**11 and step >= 2**-14) or float(torch.tensor(step).half()) == step)
    for stochastic in (True, False):
        _, out = _encode(x, cfg, impl, stochastic=stochastic)
        assert torch.equal(out, x)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_empty_one_element_zero_and_constant_buckets(impl, bits):
    cfg = {"bits": bits, "bucket_size": 128, "norm": "max", "scale_bytes": 4}
    wire, out = _encode(torch.zeros(0), cfg, impl)
    assert wire.numel() == 0 and out.numel() == 0
    for value in (3.0, -2.5e-3, 1e-40):
        one = torch.tensor([value])
        wire, out = _encode(one, cfg, impl)
        step = steps_of(wire, 1, 128).item()  # the only element is the max: one step at most
        assert abs(out.item() - one.item()) <= step and abs(out.item()) <= abs(one.item()) + step
        if abs(value) > 1e-30:
            assert out.item() == pytest.approx(one.item(), rel=1e-6)
    x = torch.zeros(300)
    x[130:] = 0.7  # bucket 0 all zero, buckets 1-2 constant
    wire, out = _encode(x, cfg, impl)
    assert bool((wire[:4] == 0).all()) and steps_of(wire, 300, 128)[0] == 0
    assert bool((out[:128] == 0).all())
    assert bool(((out[130:] - 0.7).abs() <= steps_of(wire, 300, 128)[1] * (1 + 1e-6)).all())
    start = torch.full((300,), 5.0)
    z_wire, _ = _encode(torch.zeros(300), cfg, impl)
    kernels.qsgd_decode(
        z_wire,
        start,
        bits=bits,
        levels=2 ** (bits - 1) - 1,
        bucket_size=128,
        accumulate=True,
        impl=impl,
    )
    assert bool((start == 5.0).all()), "decoding zeros with accumulate must leave out unchanged"


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("half", [False, True])
def test_denormal_buckets_keep_the_error_bound(impl, half):
    x = torch.tensor([1e-45, -3e-44, 7e-42, 0.0, 1.1754942e-38, -2e-39] * 10)
    cfg = {"bits": 4, "bucket_size": 6, "norm": "max", "scale_bytes": 2 if half else 4}
    wire, out = _encode(x, cfg, impl)
    step = per_element(steps_of(wire, x.numel(), 6, cfg["scale_bytes"]), x.numel(), 6).double()
    assert bool(torch.isfinite(out).all())
    assert bool(((out.double() - x.double()).abs() <= step).all())
    if not half:  # float32 steps resolve denormals: unbiased over many draws
        tiled = x.repeat(N_DRAWS)
        _, outs = _encode(tiled, cfg, impl)
        mean = outs.view(N_DRAWS, -1).double().mean(0)
        assert bool(((mean - x.double()).abs() <= EPS * step + 2**-149).all())


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_non_finite_input_makes_its_bucket_decode_to_nan(impl, bad, norm):
    # Chosen behaviour: propagate. A NaN/Inf poisons the scale of its bucket so every value
    # decoded from it is NaN (never a finite wrong value); other buckets are unaffected.
    x = torch.randn(300)
    x[140] = bad
    cfg = {"bits": 4, "bucket_size": 128, "norm": norm, "scale_bytes": 4}
    _, out = _encode(x, cfg, impl)
    assert bool(torch.isnan(out[128:256]).all())
    assert bool(torch.isfinite(out[:128]).all()) and bool(torch.isfinite(out[256:]).all())


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_overflow_from_the_scale_factor_and_from_half_scales_is_non_finite(impl):
    x = torch.tensor([3e38, 1.0, -2.0, 0.5])
    _, out = _encode(
        x, {"bits": 4, "bucket_size": 4, "norm": "max", "scale_bytes": 4}, impl, scale=10.0
    )
    assert bool(torch.isnan(out).all())
    big = torch.tensor([1e6, 1.0, -2.0, 0.5])  # step 1e6/7 > 65504: float16 scale overflows
    _, out = _encode(big, {"bits": 4, "bucket_size": 4, "norm": "max", "scale_bytes": 2}, impl)
    assert bool(torch.isnan(out).all())


def test_wire_size_is_exact_and_4bit_128_is_under_014_of_fp32():
    for n in (0, 1, 127, 128, 129, 1000, 1 << 20):
        assert (
            kernels.qsgd_nbytes(n, bits=4, bucket_size=128)
            == (4 * -(-n // 128) + (4 * n + 7) // 8 + 3) // 4 * 4
        )
    assert kernels.qsgd_nbytes(1 << 20, bits=4, bucket_size=128) / (4 << 20) <= 0.14
    assert kernels.qsgd_nbytes(1 << 20, bits=2, bucket_size=128) / (4 << 20) < 0.075
    assert kernels.qsgd_nbytes(1 << 20, bits=4, bucket_size=128, scale_bytes=2) / (4 << 20) < 0.13
