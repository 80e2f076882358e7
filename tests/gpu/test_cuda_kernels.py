"""CUDA codec kernels write the same bits as the torch reference (needs a GPU and CuPy)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from commopt import kernels
from tests.unit.codec_helpers import bits_equal, float_tensors

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA kernels are only compile-checked "
                "(tests/unit/test_cuda_sources.py)", allow_module_level=True)
pytest.importorskip("cupy", reason="CuPy not installed: pip install cupy-cuda12x")

configs = st.fixed_dictionaries({
    "bits": st.sampled_from([2, 4, 8]),
    # 128 and 1000 take the one-warp-per-bucket kernels, 5 (odd with 4 bits), 1 and 3000 the
    # general ones
    "bucket_size": st.sampled_from([1, 5, 32, 128, 200, 1000, 3000]),
    "norm": st.sampled_from(["max", "l2"]),
    "stochastic": st.booleans(),
    "scale_bytes": st.sampled_from([4, 2]),
    "scale": st.sampled_from([1.0, 0.125, 1 / 3]),
    "key": st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
})


@settings(max_examples=120, deadline=None)
@given(x=float_tensors(max_size=5000), cfg=configs)
def test_qsgd_cuda_matches_reference(x, cfg):
    levels = 2 ** (cfg["bits"] - 1) - 1
    nbytes = kernels.qsgd_nbytes(x.numel(), bits=cfg["bits"], bucket_size=cfg["bucket_size"],
                                 scale_bytes=cfg["scale_bytes"])
    xc = x.cuda()
    wire_ref = torch.full((nbytes,), 0xA5, dtype=torch.uint8)
    kernels.qsgd_encode(x, wire_ref, levels=levels, impl="reference", **cfg)
    wire = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    kernels.qsgd_encode(xc, wire, levels=levels, **cfg)
    assert torch.equal(wire.cpu(), wire_ref)
    params = {k: cfg[k] for k in ("bits", "bucket_size", "scale_bytes")}
    start = torch.randn(x.numel())
    for accumulate, alpha in ((False, 1.0), (True, -1.0)):
        out_ref = start.clone()
        kernels.qsgd_decode(wire_ref, out_ref, levels=levels, accumulate=accumulate, alpha=alpha,
                            impl="reference", **params)
        out = start.cuda()
        kernels.qsgd_decode(wire, out, levels=levels, accumulate=accumulate, alpha=alpha, **params)
        assert bits_equal(out.cpu(), out_ref)


@settings(max_examples=40, deadline=None)
@given(x=float_tensors(max_size=5000), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_cast_cuda_matches_reference(x, dtype):
    want = torch.empty(x.numel(), dtype=dtype)
    kernels.cast_encode(x, want, scale=0.5, impl="reference")
    got = torch.empty(x.numel(), dtype=dtype, device="cuda")
    kernels.cast_encode(x.cuda(), got, scale=0.5)
    assert bits_equal(got.cpu(), want)
    out = torch.ones(x.numel(), device="cuda")
    kernels.cast_decode(got, out, accumulate=True)
    ref = torch.ones(x.numel())
    kernels.cast_decode(want, ref, accumulate=True, impl="reference")
    assert bits_equal(out.cpu(), ref)


def test_large_buffer_on_a_side_stream():
    x = torch.randn(10_000_003, device="cuda")
    wire = torch.empty(kernels.qsgd_nbytes(x.numel(), bits=4, bucket_size=128), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.qsgd_encode(x, wire, bits=4, levels=7, bucket_size=128, key=(9, 9))
    torch.cuda.current_stream().wait_stream(stream)
    ref = torch.empty(wire.numel(), dtype=torch.uint8)
    kernels.qsgd_encode(x.cpu(), ref, bits=4, levels=7, bucket_size=128, key=(9, 9))
    assert torch.equal(wire.cpu(), ref)
