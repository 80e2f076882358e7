"""The Triton kernels write the same bits as the plain-torch reference (the spec).

Without a GPU they run under Triton's interpreter on CPU tensors (commopt.kernels sets
TRITON_INTERPRET=1 before it loads them); on a GPU machine the same tests run compiled, on
CUDA tensors. One allowance: the bits of a NaN (commopt.kernels.reference.same_bits says why).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commopt import kernels
from commopt.codecs import QSGD, CastCodec, ErrorFeedback, RngKey
from commopt.kernels.reference import same_bits, same_wire
from tests.unit.codec_helpers import float_tensors

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "needs triton: pip install triton==3.7.1 (commopt[triton])", allow_module_level=True
    )
triton_kernels = kernels._triton()  # before anything imports triton: sets TRITON_INTERPRET here
DEVICE = "cpu" if triton_kernels.INTERPRETED else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():  # pragma: no cover - set-up error
    pytest.skip("triton loaded compiled but torch sees no GPU", allow_module_level=True)

# numpy, which runs the interpreted kernels, warns where a NaN or Inf meets a cast
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

#: bucket sizes: odd ones (buckets start inside a byte), powers of two, and one above
#: MAX_WIDTH (its max norm is taken in chunks, its l2 norm by the reference's torch code).
BUCKETS = [1, 3, 5, 17, 64, 100, 128, 130, 1000, triton_kernels.MAX_WIDTH + 1]


@st.composite
def inputs(draw, max_size: int = 2500):
    """float_tensors plus inputs with NaN, Inf, huge values and denormals in random places."""
    x = draw(float_tensors(max_size=max_size))
    if x.numel() and draw(st.booleans()):
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -1e-45, 1e-40])
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        count = draw(st.integers(1, 4))
        where = torch.randint(0, x.numel(), (count,), generator=gen)
        x = x.clone()
        x[where] = specials[torch.randint(0, len(specials), (count,), generator=gen)]
    return x


qsgd_configs = st.fixed_dictionaries(
    {
        "bits": st.sampled_from([2, 4, 8]),
        "bucket_size": st.sampled_from(BUCKETS),
        "norm": st.sampled_from(["max", "l2"]),
        "stochastic": st.booleans(),
        "scale_bytes": st.sampled_from([4, 2]),
        "scale": st.sampled_from([1.0, 0.25, 1 / 3, 3e5]),
        "key": st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    }
)


@pytest.fixture
def small_blocks():
    """Run with blocks of 256 so that small inputs span several programs and a ragged end."""
    saved = triton_kernels.BLOCK
    triton_kernels.BLOCK = 256
    yield
    triton_kernels.BLOCK = saved


def _qsgd_round(x, cfg, levels):
    nbytes = kernels.qsgd_nbytes(
        x.numel(), bits=cfg["bits"], bucket_size=cfg["bucket_size"], scale_bytes=cfg["scale_bytes"]
    )
    wires = {}
    for impl, device in (("triton", DEVICE), ("reference", "cpu")):
        wire = torch.full(
            (nbytes,), 0xA5, dtype=torch.uint8, device=device
        )  # padding is written too
        kernels.qsgd_encode(x.to(device), wire, levels=levels, impl=impl, **cfg)
        wires[impl] = wire
    assert same_wire(
        wires["triton"], wires["reference"], x.numel(), cfg["bucket_size"], cfg["scale_bytes"]
    )
    params = {k: cfg[k] for k in ("bits", "bucket_size", "scale_bytes")}
    start = torch.randn(x.numel())
    # (True, -1.0) is the error-feedback residual update: r -= decode(wire), fused
    for accumulate, alpha in ((False, 1.0), (True, 1.0), (True, -1.0), (False, 0.5)):
        outs = {}
        for impl, device in (("triton", DEVICE), ("reference", "cpu")):
            out = start.clone().to(device)
            kernels.qsgd_decode(
                wires["reference"].to(device),
                out,
                levels=levels,
                accumulate=accumulate,
                alpha=alpha,
                impl=impl,
                **params,
            )
            outs[impl] = out
        assert same_bits(outs["triton"], outs["reference"])


@settings(max_examples=150, deadline=None)
@given(x=inputs(), cfg=qsgd_configs, data=st.data())
def test_qsgd_triton_matches_reference(x, cfg, data):
    levels = (
        data.draw(st.integers(1, 2 ** (cfg["bits"] - 1) - 1))
        if data.draw(st.booleans())
        else 2 ** (cfg["bits"] - 1) - 1
    )
    _qsgd_round(x, cfg, levels)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("norm", ["max", "l2"])
@pytest.mark.parametrize("wide", [False, True], ids=["int32-index", "int64-index"])
def test_qsgd_across_program_boundaries(small_blocks, monkeypatch, bits, norm, wide):
    # int64 indices are taken from 2^31 elements on; forced here on a small buffer
    monkeypatch.setattr(triton_kernels, "_wide", lambda n, bucket_size: wide)
    # 1000 elements in blocks of 256: four programs, the last one ragged; bucket 37 crosses them
    x = torch.randn(1000, generator=torch.Generator().manual_seed(bits)) * 5
    x[500] = float("inf")
    cfg = dict(
        bits=bits,
        bucket_size=37,
        norm=norm,
        stochastic=True,
        scale_bytes=4,
        scale=1.0,
        key=(7, 2**32 - 7),
    )
    _qsgd_round(x, cfg, 2 ** (bits - 1) - 1)


@pytest.mark.parametrize("bucket_size", [1, 128, triton_kernels.MAX_WIDTH + 1])
def test_qsgd_all_zero_and_all_nan_buckets(bucket_size):
    for x in (torch.zeros(300), torch.full((300,), float("nan")), torch.full((300,), -0.0)):
        for norm in ("max", "l2"):
            cfg = dict(
                bits=4,
                bucket_size=bucket_size,
                norm=norm,
                stochastic=True,
                scale_bytes=2,
                scale=1.0,
                key=(1, 2),
            )
            _qsgd_round(x, cfg, 7)


@settings(max_examples=60, deadline=None)
@given(
    x=inputs(max_size=3000),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    scale=st.sampled_from([1.0, 0.5, 1 / 7, 1e-3, 3e4]),
)
def test_cast_triton_matches_reference(x, dtype, scale):
    wires = {}
    for impl, device in (("triton", DEVICE), ("reference", "cpu")):
        wire = torch.empty(x.numel(), dtype=dtype, device=device)
        kernels.cast_encode(x.to(device), wire, scale=scale, impl=impl)
        wires[impl] = wire
    assert same_bits(wires["triton"], wires["reference"])
    start = torch.randn(x.numel())
    for accumulate, alpha in ((False, 1.0), (True, 1.0), (True, -1.0), (True, 0.25)):
        outs = {}
        for impl, device in (("triton", DEVICE), ("reference", "cpu")):
            out = start.clone().to(device)
            kernels.cast_decode(
                wires["reference"].to(device), out, accumulate=accumulate, alpha=alpha, impl=impl
            )
            outs[impl] = out
        assert same_bits(outs["triton"], outs["reference"])


def test_bfloat16_ties_round_to_even():
    # halfway cases: 1 + 2^-8 -> 1 (even), 1 + 3 * 2^-8 -> 1 + 2^-6 (even), and the largest
    # float rounding to Inf
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4028235e38, 1e-45])
    got = torch.empty(5, dtype=torch.bfloat16, device=DEVICE)
    kernels.cast_encode(x.to(DEVICE), got, impl="triton")
    assert same_bits(got, x.to(torch.bfloat16))
    assert got.cpu().float().tolist()[:3] == [1.0, 1 + 2**-6, -1.0]


@pytest.mark.parametrize(
    "codec", [QSGD(2, 5, stochastic=False), QSGD(4, 128, "l2"), CastCodec(torch.float16)], ids=repr
)
def test_error_feedback_steps_match_the_reference(monkeypatch, codec):
    # the residual update r <- y - decode(encode(y)) over three steps, through the codec API
    xs = [torch.randn(777, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    runs = {}
    for impl, device in (("triton", DEVICE), ("reference", "cpu")):
        monkeypatch.setenv(kernels.ENV_VAR, impl)
        ef = ErrorFeedback(codec)
        wires = []
        for step, x in enumerate(xs):
            wire = torch.empty(ef.encoded_nbytes(777), dtype=torch.uint8, device=device)
            ef.encode(x.to(device), wire, scale=0.5, rng=RngKey(0, 1, step), key="b")
            wires.append(wire.cpu())
        runs[impl] = (wires, ef.residual("b").cpu())
    for a, b in zip(runs["triton"][0], runs["reference"][0]):
        assert torch.equal(a, b)
    assert same_bits(runs["triton"][1], runs["reference"][1])


def test_impl_triton_is_selectable_and_checked():
    x = torch.randn(10, device=DEVICE)
    assert kernels._pick("triton", x) == "triton"
    if DEVICE == "cpu":
        assert kernels.triton_interpreted()
