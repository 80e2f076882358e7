"""One contract every Codec must meet, run over every codec commopt ships.

Every test runs twice: with the default kernels for CPU tensors (native, or the reference
where the library is not built) and with ``COMMOPT_KERNELS=triton``, i.e. through the Triton
GPU kernels under Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from commopt import kernels
from commopt.codecs import QSGD, Codec, ErrorFeedback, RngKey, get_codec
from tests.unit.codec_helpers import float_tensors


def _all_codecs():
    plain = {
        "none": lambda: get_codec("none"),
        "fp16": lambda: get_codec("fp16"),
        "bf16": lambda: get_codec("bf16"),
        "qsgd2": lambda: get_codec("qsgd2"),
        "qsgd4": lambda: get_codec("qsgd4"),
        "qsgd8": lambda: get_codec("qsgd8"),
        "qsgd4-l2": lambda: QSGD(4, 128, "l2"),
        "qsgd4-nearest": lambda: QSGD(4, 128, stochastic=False),
        "qsgd8-b100-halfscale": lambda: QSGD(8, 100, scale_dtype=torch.float16),
        "qsgd4-levels3": lambda: QSGD(4, 64, levels=3),
    }
    out = dict(plain)
    for name, make in plain.items():
        out[name + "+ef"] = lambda make=make: ErrorFeedback(make())
    return out


CODECS = _all_codecs()


@pytest.fixture(autouse=True, params=["default", "triton"])
def kernel_impl(request, monkeypatch):
    """The kernels behind every codec call of the test (see the module docstring)."""
    if request.param == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("needs triton: pip install triton==3.7.1 (commopt[triton])")
        if not kernels.triton_interpreted():
            pytest.skip("triton is compiled for the GPU here; CPU tensors need TRITON_INTERPRET=1")
        monkeypatch.setenv(kernels.ENV_VAR, "triton")
    return request.param


def _bound(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """An upper bound of |decode(encode(x)) - x| per element for a one-shot encode."""
    inner = codec.inner if isinstance(codec, ErrorFeedback) else codec
    if isinstance(inner, QSGD):
        B = inner.bucket_size
        nb = -(-x.numel() // B)
        padded = torch.nn.functional.pad(x.abs(), (0, nb * B - x.numel())).view(nb, B)
        norm = padded.amax(1) if inner.norm == "max" else padded.double().norm(dim=1).float()
        step = (norm / inner.levels) * (1 + 2**-10) + 2**-24 * (inner.scale_dtype == torch.float16)
        return step.repeat_interleave(B)[: x.numel()] * (1.0 if inner.stochastic else 0.5) * 1.001
    rel = {torch.float32: 0.0, torch.float16: 2**-11, torch.bfloat16: 2**-8}[inner.dtype]
    # half an ulp relative, or half the smallest subnormal of the wire dtype
    absolute = {torch.float32: 0.0, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}[inner.dtype]
    return x.abs() * rel + absolute


def _round_trip(codec, x, *, scale=1.0, key="k"):
    wire = torch.empty(codec.encoded_nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, wire, scale=scale, rng=RngKey(seed=3, rank=1, reduction=7), key=key)
    out = torch.empty(x.numel())
    codec.decode(wire, out)
    return wire, out


NAMES = sorted(CODECS)


@pytest.fixture(params=NAMES)
def codec(request):
    return CODECS[request.param]()


def test_attributes(codec):
    assert isinstance(codec.name, str) and codec.name
    assert isinstance(codec.linear, bool) and codec.alignment >= 1
    if codec.linear:
        assert codec.wire_dtype is not None
        assert (
            codec.encoded_nbytes(10) % codec.wire_dtype.itemsize == 0
        )  # a whole number of elements


@pytest.mark.parametrize("name", NAMES)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(x=float_tensors(max_size=700).filter(lambda t: t.numel() == 0 or t.abs().max() < 3e4))
def test_round_trip_within_the_codec_bound(name, x):
    codec = CODECS[name]()  # fresh per example: error feedback would carry residuals over
    wire, out = _round_trip(codec, x)
    assert wire.numel() == codec.encoded_nbytes(x.numel())
    assert bool(((out.double() - x.double()).abs() <= _bound(codec, x).double()).all())


@pytest.mark.parametrize("n", [0, 1, 129, 1000])
def test_encoded_nbytes_is_exact_and_enforced(codec, n):
    x = torch.randn(n)
    size = codec.encoded_nbytes(n)
    assert size % (4 if not codec.linear else codec.wire_dtype.itemsize) == 0
    for wrong in (size + 4, size - 1):
        if wrong < 0:
            continue
        with pytest.raises(ValueError, match="encoded_nbytes"):
            codec.encode(x, torch.empty(wrong, dtype=torch.uint8), key=("size", n))
    wire = torch.full((size,), 0xFF, dtype=torch.uint8)
    codec.encode(x, wire, rng=RngKey(1, 0, 0), key=("size", n))
    out = torch.empty(n)
    codec.decode(wire, out)  # every byte was written: no 0xFF garbage decodes to NaN
    assert bool(torch.isfinite(out).all())


def test_decode_accumulates(codec):
    x = torch.randn(513)
    wire, decoded = _round_trip(codec, x)
    acc = torch.linspace(-3, 3, 513)
    expected = acc + decoded
    codec.decode(wire, acc, accumulate=True)
    assert torch.equal(acc, expected)


def test_decode_own_gives_decode_scaleds_values(codec):
    # error feedback's read-back of its own wire skips the untrusted-wire checks, not a bit
    x = torch.randn(513)
    wire, _ = _round_trip(codec, x)
    acc = torch.linspace(-3, 3, 513)
    own, expected = acc.clone(), acc.clone()
    codec.decode_scaled(wire, expected, accumulate=True, alpha=-1.0)
    codec.decode_own(wire, own, accumulate=True, alpha=-1.0)
    assert torch.equal(own, expected)


def test_empty_input(codec):
    wire, out = _round_trip(codec, torch.zeros(0))
    assert wire.numel() == 0 and out.numel() == 0


def test_scale_is_applied_before_rounding(codec):
    x = torch.randn(1000) * 1000
    _, out = _round_trip(codec, x, scale=0.125)
    assert bool(((out.double() - (x / 8).double()).abs() <= _bound(codec, x / 8).double()).all())
    # dividing by the world size first keeps float16 sums finite (70000 overflows fp16)
    _, out = _round_trip(codec, torch.full((256,), 70000.0), scale=0.25, key="overflow")
    assert bool(torch.isfinite(out).all())


def test_wrong_input_types_raise_clear_errors(codec):
    wire = torch.empty(codec.encoded_nbytes(8), dtype=torch.uint8)
    with pytest.raises(TypeError, match="float32"):
        codec.encode(torch.zeros(8, dtype=torch.float64), wire)
    with pytest.raises(TypeError, match="uint8"):
        codec.encode(torch.zeros(8), torch.empty(codec.encoded_nbytes(8) // 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous"):
        codec.encode(torch.zeros(16)[::2], wire)


def test_unaligned_wire_slices_work(codec):
    # the collectives pack several wires into one buffer; a slice may start at any byte
    x = torch.randn(300)
    wire, want = _round_trip(codec, x, key="aligned")
    big = torch.zeros(wire.numel() + 3, dtype=torch.uint8)
    if isinstance(codec, ErrorFeedback):
        codec.reset()
    codec.encode(x, big[3:], rng=RngKey(seed=3, rank=1, reduction=7), key="aligned")
    assert torch.equal(big[3:], wire)
    out = torch.empty(300)
    codec.decode(big[3:], out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trips_through_torch_save(name):
    codec = CODECS[name]()
    x = torch.randn(200)
    wire = torch.empty(codec.encoded_nbytes(200), dtype=torch.uint8)
    codec.encode(x, wire, rng=RngKey(0, 0, 0), key=0)
    buf = io.BytesIO()
    torch.save(codec.state_dict(), buf)
    buf.seek(0)
    fresh = CODECS[name]()
    fresh.load_state_dict(torch.load(buf))
    # the restored codec continues exactly like the original
    y = torch.randn(200)
    w1, w2 = torch.empty_like(wire), torch.empty_like(wire)
    codec.encode(y, w1, rng=RngKey(0, 0, 1), key=0)
    fresh.encode(y, w2, rng=RngKey(0, 0, 1), key=0)
    assert torch.equal(w1, w2)
    if not isinstance(codec, ErrorFeedback):
        assert codec.state_dict() == {}
        with pytest.raises(ValueError, match="no state"):
            codec.load_state_dict({"residuals": {}})


def test_linear_wires_sum_like_their_values(codec):
    if not codec.linear:
        pytest.skip("not linear: wires must be decoded before they are added")
    xs = [torch.randn(64) for _ in range(4)]
    wires = []
    for i, x in enumerate(xs):
        w = torch.empty(codec.encoded_nbytes(64), dtype=torch.uint8)
        codec.encode(x, w, scale=0.25, key=("lin", i))
        wires.append(w.view(codec.wire_dtype).float())
    total = sum(wires)
    assert torch.allclose(total, sum(xs) / 4, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,world", [(1000, 3), (257, 4), (5, 2), (128 * 3 + 1, 3)])
def test_chunks_at_alignment_boundaries_encode_like_the_whole(name, n, world):
    # The collectives split a buffer per rank at multiples of codec.alignment; sizes need
    # not be multiples of the bucket or of the world size. Each chunk must then carry the
    # same bucket scales as an encode of the whole buffer would.
    codec = CODECS[name]()
    x = torch.randn(n)
    step = -(-n // world)
    step = -(-step // codec.alignment) * codec.alignment
    bounds = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
    out = torch.empty(n)
    for i, (lo, hi) in enumerate(bounds):
        wire = torch.empty(codec.encoded_nbytes(hi - lo), dtype=torch.uint8)
        codec.encode(x[lo:hi], wire, rng=RngKey(0, 0, 0, stream=i), key=("chunk", i))
        codec.decode(wire, out[lo:hi])
    assert bool(((out.double() - x.double()).abs() <= _bound(codec, x).double()).all())
    inner = codec.inner if isinstance(codec, ErrorFeedback) else codec
    if isinstance(inner, QSGD):
        whole = torch.empty(codec.encoded_nbytes(n), dtype=torch.uint8)
        inner.encode(x, whole, rng=RngKey(0, 0, 0))
        nb = -(-n // inner.bucket_size)
        scales = []
        for i, (lo, hi) in enumerate(bounds):
            wire = torch.empty(inner.encoded_nbytes(hi - lo), dtype=torch.uint8)
            inner.encode(x[lo:hi], wire, rng=RngKey(0, 0, 0, stream=i))
            scales.append(wire[: -(-(hi - lo) // inner.bucket_size) * inner._scale_bytes])
        assert torch.equal(torch.cat(scales), whole[: nb * inner._scale_bytes])
