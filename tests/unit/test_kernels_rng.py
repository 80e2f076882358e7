"""The counter-based generator: pinned values, uniformity, and independence of keys."""

from __future__ import annotations

import torch

from commopt import kernels
from commopt.kernels import reference as ref

M32 = 0xFFFFFFFF


def _mix32_python(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_torch_generator_matches_exact_integer_arithmetic():
    # int64 tensor arithmetic must give the same words as unbounded Python integers,
    # including indices and keys near 2^32 (where a naive product would overflow int64)
    idx = torch.tensor([0, 1, 2, 12345, 2**31, 2**32 - 1], dtype=torch.int64)
    for key in ((0, 0), (1, 2), (M32, M32), (0x9E3779B9, 0x7F4A7C15)):
        got = ref.uniform_bits(idx, key).tolist()
        want = [_mix32_python(_mix32_python((i + key[0]) & M32) ^ key[1]) for i in idx.tolist()]
        assert got == want


def test_pinned_key_words_and_words_do_not_drift():
    # Known answers: changing the generator would silently change every run's wires
    # (and break reproducibility across versions), so it is pinned here (docs/codecs.md).
    assert kernels.rng_words(1, 2, 3, 4) == (750182429, 2947109202)
    assert kernels.rng_words(0, 0, 0, 0) == (2551687587, 1161041978)
    words = ref.uniform_bits(torch.arange(4), kernels.rng_words(1, 2, 3, 4)).tolist()
    assert words == [817192213, 3719526517, 2805758884, 2050363501]
    assert _mix32_python(0) == 0  # the finaliser fixes 0; the key offset k0 moves index 0 off it


def test_words_are_uniform_chi_square():
    n = 1 << 18
    u = ref.uniform_bits(torch.arange(n, dtype=torch.int64), kernels.rng_words(7, 3, 11, 2))
    counts = torch.bincount((u >> 24).long(), minlength=256).double()
    chi2 = (((counts - n / 256) ** 2) / (n / 256)).sum().item()
    assert chi2 < 360  # 255 degrees of freedom: P(chi2 > 360) ~ 1e-5
    low = torch.bincount((u & 0xFF).long(), minlength=256).double()
    assert (((low - n / 256) ** 2) / (n / 256)).sum().item() < 360


def test_keys_give_independent_streams():
    idx = torch.arange(1 << 14, dtype=torch.int64)
    keys = [kernels.rng_words(0, r, s, c) for r in range(2) for s in range(2) for c in range(2)]
    assert len(set(keys)) == len(keys)
    streams = [ref.uniform_bits(idx, k) for k in keys]
    for i in range(len(streams)):
        for j in range(i + 1, len(streams)):
            same = (streams[i] == streams[j]).float().mean().item()
            assert same < 1e-3
            a = (streams[i] >> 8).double() / 2**24 - 0.5
            b = (streams[j] >> 8).double() / 2**24 - 0.5
            corr = (a * b).mean().item() / 0.0833
            assert abs(corr) < 0.05  # ~6 sigma for 16k samples
