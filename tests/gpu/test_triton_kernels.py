"""The Triton kernels, compiled, on the GPU: the same bits as the reference computed on the CPU.

The CPU suite runs the same source under Triton's interpreter (tests/unit/test_kernels_triton.py,
which on a GPU machine also runs on CUDA tensors); this file adds large ragged buffers, every
bucket class and the launch path with several programs per kernel.
"""

from __future__ import annotations

import itertools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device: the Triton kernels run here under the interpreter only "
        "(tests/unit/test_kernels_triton.py)",
        allow_module_level=True,
    )
pytest.importorskip(
    "triton", reason="CUDA builds of torch bring triton; else pip install triton==3.7.1"
)

from commopt import kernels
from tests.unit.test_kernels_triton import BUCKETS, same_bits, same_wire


def _input(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    if n > 10:
        x[3], x[n // 2], x[-2] = 1e-41, float("inf"), float("nan")
    return x


def test_triton_is_the_default_for_cuda_tensors():
    x = torch.randn(4, device="cuda")
    assert kernels._pick(None, x) == "triton" and not kernels.triton_interpreted()


@pytest.mark.parametrize(
    "bits,norm,stochastic,scale_bytes",
    list(itertools.product([2, 4, 8], ["max", "l2"], [True, False], [4, 2])),
)
def test_qsgd_on_the_device_matches_the_reference(bits, norm, stochastic, scale_bytes):
    levels = 2 ** (bits - 1) - 1
    # many programs per launch: 100003 everywhere, 3 Mi + 5 for the common and the widest bucket
    cases = [(b, n) for b in BUCKETS for n in (1, 1000, 100_003)] + [
        (128, 3 * 2**20 + 5),
        (BUCKETS[-1], 3 * 2**20 + 5),
    ]
    for bucket, n in cases:
        x = _input(n, bucket + n)
        cfg = dict(
            bits=bits,
            levels=levels,
            bucket_size=bucket,
            norm=norm,
            stochastic=stochastic,
            scale_bytes=scale_bytes,
            scale=0.5,
            key=(12345, 2**32 - 3),
        )
        nbytes = kernels.qsgd_nbytes(n, bits=bits, bucket_size=bucket, scale_bytes=scale_bytes)
        want = torch.full((nbytes,), 0xA5, dtype=torch.uint8)
        got = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
        kernels.qsgd_encode(x, want, impl="reference", **cfg)
        kernels.qsgd_encode(x.cuda(), got, **cfg)
        assert same_wire(got, want, n, bucket, scale_bytes), (bucket, n)
        start = torch.randn(n)
        params = dict(bits=bits, levels=levels, bucket_size=bucket, scale_bytes=scale_bytes)
        out_ref, out = start.clone(), start.cuda()
        kernels.qsgd_decode(want, out_ref, accumulate=True, alpha=-1.0, impl="reference", **params)
        kernels.qsgd_decode(want.cuda(), out, accumulate=True, alpha=-1.0, **params)
        assert same_bits(out, out_ref), (bucket, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_casts_on_the_device_match_the_reference(dtype):
    x = _input(2**22 + 7, 0)
    for scale in (1.0, 1 / 3):
        want = torch.empty(x.numel(), dtype=dtype)
        got = torch.empty(x.numel(), dtype=dtype, device="cuda")
        kernels.cast_encode(x, want, scale=scale, impl="reference")
        kernels.cast_encode(x.cuda(), got, scale=scale)
        assert same_bits(got, want)
        out_ref, out = torch.ones(x.numel()), torch.ones(x.numel(), device="cuda")
        kernels.cast_decode(want, out_ref, accumulate=True, alpha=0.25, impl="reference")
        kernels.cast_decode(want.cuda(), out, accumulate=True, alpha=0.25)
        assert same_bits(out, out_ref)


def test_kernels_run_on_the_current_stream():
    # launched on torch's current stream: work on a side stream orders without a sync
    x = torch.randn(2**20, device="cuda")
    side = torch.cuda.Stream()
    wire = torch.empty(
        kernels.qsgd_nbytes(x.numel(), bits=4, bucket_size=128), dtype=torch.uint8, device="cuda"
    )
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2
        kernels.qsgd_encode(y, wire, bits=4, levels=7, bucket_size=128, key=(1, 2))
    torch.cuda.current_stream().wait_stream(side)
    want = torch.empty(wire.numel(), dtype=torch.uint8)
    kernels.qsgd_encode(
        (x * 2).cpu(), want, bits=4, levels=7, bucket_size=128, key=(1, 2), impl="reference"
    )
    assert torch.equal(wire.cpu(), want)
