"""Shared pieces of the codec and kernel tests: input strategies and wire helpers."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from commopt import kernels

#: float32 values hypothesis may draw, denormals and extremes included (no NaN/Inf).
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
#: the kernel implementations testable on this machine (the Triton kernels run on GPUs in tests/gpu and under the interpreter in tests/unit/test_kernels_triton.py).
CPU_IMPLS = ["reference"] + (["native"] if kernels.native_available() else [])


@st.composite
def float_tensors(draw, max_size: int = 600, min_size: int = 0):
    """A float32 tensor: hypothesis-chosen values (small), or seeded heavy-tailed random ones."""
    n = draw(st.integers(min_size, max_size))
    kind = draw(st.sampled_from(["values", "random", "random", "constant", "zeros", "tiny"]))
    if kind == "values" and n <= 64:
        vals = draw(st.lists(finite32, min_size=n, max_size=n))
        return torch.tensor(vals, dtype=torch.float32)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "constant":
        return torch.full((n,), draw(finite32), dtype=torch.float32)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "tiny":  # denormals and values near the bottom of the float range
        return torch.randn(n, generator=gen) * 1e-41
    spread = draw(st.sampled_from([0.0, 1.0, 4.0]))
    return torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * spread)


def qsgd_params(bits: int) -> dict:
    return {"bits": bits, "levels": 2 ** (bits - 1) - 1}


def steps_of(
    wire: torch.Tensor, numel: int, bucket_size: int, scale_bytes: int = 4
) -> torch.Tensor:
    """The per-bucket level spacings stored at the head of a QSGD wire, as float32."""
    nb = -(-numel // bucket_size)
    dtype = torch.float32 if scale_bytes == 4 else torch.float16
    return wire[: nb * scale_bytes].clone().view(dtype).float()


def per_element(steps: torch.Tensor, numel: int, bucket_size: int) -> torch.Tensor:
    return steps.repeat_interleave(bucket_size)[:numel]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), for float tensors of any width."""
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))
