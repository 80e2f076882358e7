"""Cast codecs: rounding, overflow protection by the scale, float32 accumulation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commopt.codecs import CastCodec, NoneCodec, get_codec
from tests.unit.codec_helpers import bits_equal, float_tensors


def _encode(codec, x, scale=1.0):
    wire = torch.empty(codec.encoded_nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, wire, scale=scale)
    return wire


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@settings(max_examples=25, deadline=None)
@given(x=float_tensors(max_size=500), scale=st.sampled_from([1.0, 0.5, 1 / 3, 1 / 8]))
def test_wire_is_the_round_to_nearest_even_cast(dtype, x, scale):
    codec = CastCodec(dtype)
    wire = _encode(codec, x, scale)
    assert bits_equal(wire.view(dtype), (x * scale).to(dtype))
    out = torch.empty(x.numel())
    codec.decode(wire, out)
    assert bits_equal(out, (x * scale).to(dtype).float())


def test_names_and_linearity():
    assert [get_codec(n).name for n in ("none", "fp32", "fp16", "bf16")] == [
        "none",
        "none",
        "fp16",
        "bf16",
    ]
    assert isinstance(get_codec("none"), NoneCodec)
    for n in ("none", "fp16", "bf16"):
        assert get_codec(n).linear and get_codec(n).alignment == 1
    with pytest.raises(ValueError, match="dtype"):
        CastCodec(torch.int8)


def test_dividing_by_the_world_size_keeps_a_float16_sum_finite():
    world = 8
    grads = [torch.full((64,), 20000.0) for _ in range(world)]  # the fp16 sum would be 160000
    codec = get_codec("fp16")
    unscaled = sum(_encode(codec, g).view(torch.float16) for g in grads)
    assert bool(torch.isinf(unscaled).all())  # what the scale protects against
    scaled = sum(_encode(codec, g, scale=1 / world).view(torch.float16) for g in grads)
    assert bool(torch.isfinite(scaled).all())
    assert abs(scaled[0].item() - 20000.0) <= 20000.0 * 2**-8  # 16-bit sums round at each add


def test_accumulating_decodes_in_float32_keeps_precision_a_float16_sum_loses():
    codec = get_codec("fp16")
    parts = [torch.full((16,), 1.0), *[torch.full((16,), 2.0**-12) for _ in range(64)]]
    wires = [_encode(codec, p) for p in parts]
    acc = torch.zeros(16)
    for w in wires:
        codec.decode(w, acc, accumulate=True)
    assert acc[0].item() == 1.0 + 64 * 2.0**-12  # exact in float32
    half_sum = torch.zeros(16, dtype=torch.float16)
    for w in wires:
        half_sum += w.view(torch.float16)
    assert half_sum[0].item() == 1.0  # each 2^-12 is below half an fp16 ulp of 1.0: lost


@pytest.mark.parametrize("name", ["fp16", "bf16", "none"])
def test_nan_and_inf_propagate(name):
    codec = get_codec(name)
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, 1e30])
    out = torch.empty(5)
    codec.decode(_encode(codec, x), out)
    assert (
        torch.isnan(out[0]) and out[1] == float("inf") and out[2] == -float("inf") and out[3] == 1.0
    )
    if name == "fp16":
        assert out[4] == float("inf")  # beyond the float16 range: the optimizer's check sees it
