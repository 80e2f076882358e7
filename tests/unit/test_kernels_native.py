"""The native C++ kernels write the same bits as the plain-torch reference (the spec)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commopt import kernels
from commopt.kernels import reference as ref
from tests.unit.codec_helpers import bits_equal, float_tensors

pytestmark = pytest.mark.skipif(
    not kernels.native_available(),
    reason="commopt_ext._cpu not built (python setup.py build_ext --inplace)",
)

qsgd_configs = st.fixed_dictionaries(
    {
        "bits": st.sampled_from([2, 4, 8]),
        "bucket_size": st.sampled_from([1, 3, 5, 17, 64, 128, 130, 1000]),
        "norm": st.sampled_from(["max", "l2"]),
        "stochastic": st.booleans(),
        "scale_bytes": st.sampled_from([4, 2]),
        "scale": st.sampled_from([1.0, 0.25, 1 / 3, 3e5]),
        "key": st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    }
)


def _levels(cfg, data):
    return (
        data.draw(st.integers(1, 2 ** (cfg["bits"] - 1) - 1))
        if data.draw(st.booleans())
        else 2 ** (cfg["bits"] - 1) - 1
    )


@settings(max_examples=150, deadline=None)
@given(x=float_tensors(max_size=2500), cfg=qsgd_configs, data=st.data())
def test_qsgd_native_matches_reference(x, cfg, data):
    levels = _levels(cfg, data)
    nbytes = kernels.qsgd_nbytes(
        x.numel(), bits=cfg["bits"], bucket_size=cfg["bucket_size"], scale_bytes=cfg["scale_bytes"]
    )
    wires = []
    for impl in ("native", "reference"):
        wire = torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # padding must be written too
        kernels.qsgd_encode(x, wire, levels=levels, impl=impl, **cfg)
        wires.append(wire)
    assert torch.equal(wires[0], wires[1])
    params = {k: cfg[k] for k in ("bits", "bucket_size", "scale_bytes")}
    start = torch.randn(x.numel())
    for accumulate, alpha in ((False, 1.0), (True, 1.0), (True, -1.0), (False, 0.5)):
        outs = []
        for impl in ("native", "reference"):
            out = start.clone()
            kernels.qsgd_decode(
                wires[0],
                out,
                levels=levels,
                accumulate=accumulate,
                alpha=alpha,
                impl=impl,
                **params,
            )
            outs.append(out)
        assert bits_equal(outs[0], outs[1])


@settings(max_examples=60, deadline=None)
@given(
    x=float_tensors(max_size=3000),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    scale=st.sampled_from([1.0, 0.5, 1 / 7, 1e-3, 3e4]),
)
def test_cast_native_matches_reference(x, dtype, scale):
    a = torch.empty(x.numel(), dtype=dtype)
    b = torch.empty(x.numel(), dtype=dtype)
    kernels.cast_encode(x, a, scale=scale, impl="native")
    kernels.cast_encode(x, b, scale=scale, impl="reference")
    assert bits_equal(a, b)
    start = torch.randn(x.numel())
    for accumulate, alpha in ((False, 1.0), (True, 1.0), (True, -0.25)):
        outs = [start.clone(), start.clone()]
        kernels.cast_decode(a, outs[0], accumulate=accumulate, alpha=alpha, impl="native")
        kernels.cast_decode(a, outs[1], accumulate=accumulate, alpha=alpha, impl="reference")
        assert bits_equal(outs[0], outs[1])


def _all_floats(stride: int) -> torch.Tensor:
    # every stride-th bit pattern plus the boundaries of the half/bfloat16 ranges
    pats = torch.arange(0, 2**32, stride, dtype=torch.int64)
    edges = torch.tensor(
        [
            0x33000000,
            0x33000001,
            0x387FC000,
            0x387FE000,
            0x38800000,
            0x477FE000,
            0x477FEFFF,
            0x477FF000,
            0x477FFFFF,
            0x7F7FFFFF,
            0x7F800000,
            0x00000001,
        ],
        dtype=torch.int64,
    )
    pats = torch.cat([pats, edges, edges | 0x80000000])
    return (pats - ((pats >> 31) << 32)).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_conversions_match_torch_over_the_float_range(dtype):
    x = _all_floats(stride=4099)  # ~1M patterns covering every exponent
    x = x[~torch.isnan(x)]  # NaN payloads are free; NaN-ness is checked below
    ours = torch.empty(x.numel(), dtype=dtype)
    kernels.cast_encode(x, ours, impl="native")
    assert bits_equal(ours, x.to(dtype))
    back = torch.empty(x.numel())
    kernels.cast_decode(ours, back, impl="native")
    assert bits_equal(back, ours.float())
    nan = torch.tensor([float("nan"), -float("nan")])
    out = torch.empty(2, dtype=dtype)
    kernels.cast_encode(nan, out, impl="native")
    assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("bits,norm,bucket", [(4, "max", 128), (2, "l2", 100), (8, "max", 7)])
def test_threads_do_not_change_the_wire(bits, norm, bucket):
    # above the parallel threshold the work is split over threads; the wire must not move
    x = torch.randn(200_003) * torch.exp(torch.randn(200_003))
    lv = 2 ** (bits - 1) - 1
    nbytes = kernels.qsgd_nbytes(x.numel(), bits=bits, bucket_size=bucket)
    wires = []
    for impl, threads in (("native", 1), ("native", 2), ("native", 3), ("reference", None)):
        wire = torch.empty(nbytes, dtype=torch.uint8)
        kernels.qsgd_encode(
            x,
            wire,
            bits=bits,
            levels=lv,
            bucket_size=bucket,
            key=(5, 6),
            norm=norm,
            impl=impl,
            threads=threads,
        )
        wires.append(wire)
    assert all(torch.equal(w, wires[-1]) for w in wires[:-1])
    outs = []
    for threads in (1, 2):
        out = torch.ones(x.numel())
        kernels.qsgd_decode(
            wires[0],
            out,
            bits=bits,
            levels=lv,
            bucket_size=bucket,
            accumulate=True,
            impl="native",
            threads=threads,
        )
        outs.append(out)
    ref_out = torch.ones(x.numel())
    ref.qsgd_decode(wires[0], ref_out, bits=bits, levels=lv, bucket_size=bucket, accumulate=True)
    assert bits_equal(outs[0], ref_out) and bits_equal(outs[1], ref_out)
    h1, h2 = (
        torch.empty(x.numel(), dtype=torch.float16),
        torch.empty(x.numel(), dtype=torch.float16),
    )
    kernels.cast_encode(x, h1, impl="native", threads=2)
    kernels.cast_encode(x, h2, impl="reference")
    assert bits_equal(h1, h2)


def test_native_rejects_bad_arguments_with_an_error():
    from commopt.kernels import native as _native_kernels

    lib = _native_kernels.load()
    x = torch.zeros(8)
    out = torch.zeros(64, dtype=torch.uint8)
    # bits=3 is not a packing the kernels know: the C function refuses instead of writing
    assert (
        lib.commopt_qsgd_encode(x.data_ptr(), out.data_ptr(), 8, 3, 3, 4, 0, 1, 0, 0, 1.0, 4, 1)
        == -1
    )
    with pytest.raises(ValueError, match="bits must be one of"):
        kernels.qsgd_encode(x, out, bits=3, levels=3, bucket_size=4, key=(0, 0), impl="native")


# ---- pack and check (kernels.pack_nonfinite, kernels.nonfinite) against the reference

_SPECIALS = [float("nan"), float("inf"), float("-inf"), -float("nan")]


@st.composite
def _pieces(draw):
    """Float32 pieces (some None: zeros), each maybe holding a NaN/Inf, laid out with gaps."""
    pieces, offset = [], draw(st.integers(0, 5))
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.integers(0, 4)) == 0:
            n = draw(st.integers(0, 300))
            pieces.append((None, offset, n))
        else:
            x = draw(float_tensors(max_size=70_000))  # past the threads' cut-over (32768)
            if x.numel() and draw(st.booleans()):
                x[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(_SPECIALS))
            pieces.append((x, offset, x.numel()))
        offset += pieces[-1][2] + draw(st.integers(0, 3))
    return pieces, offset


@settings(max_examples=80, deadline=None)
@given(case=_pieces(), threads=st.sampled_from([1, 2, 3]))
def test_pack_nonfinite_native_matches_reference(case, threads):
    pieces, size = case
    fill = torch.full((size,), 5.0)
    got, want = fill.clone(), fill.clone()
    flag = kernels.pack_nonfinite(pieces, got, impl="native", threads=threads)
    ref_flag = kernels.pack_nonfinite(pieces, want, impl="reference")
    assert bits_equal(got, want)
    assert flag == ref_flag
    expect = any(src is not None and not bool(torch.isfinite(src).all()) for src, _, _ in pieces)
    assert flag == expect


@settings(max_examples=80, deadline=None)
@given(
    x=float_tensors(max_size=100_000),
    where=st.floats(0, 1),
    special=st.sampled_from(_SPECIALS + [None]),
    threads=st.sampled_from([1, 2, 4]),
)
def test_nonfinite_native_matches_reference(x, where, special, threads):
    if special is not None and x.numel():
        x[min(int(where * x.numel()), x.numel() - 1)] = special
    assert kernels.nonfinite(x, impl="native", threads=threads) == kernels.nonfinite(
        x, impl="reference"
    )
    assert kernels.nonfinite(x, impl="native") == (not bool(torch.isfinite(x).all()))


def test_nonfinite_is_exact_where_a_sum_overflows():
    # flat.sum() of two large finite values is Inf: the check by sum flags it, this one not.
    x = torch.tensor([3e38, 3e38])
    assert not bool(torch.isfinite(x.sum()))
    assert kernels.nonfinite(x, impl="native") is False


def test_pack_nonfinite_rejects_bad_pieces_with_an_error():
    dst = torch.zeros(10)
    with pytest.raises(ValueError, match="outside dst"):
        kernels.pack_nonfinite([(torch.ones(4), 8, 4)], dst, impl="native")
    with pytest.raises(ValueError, match="overlap"):
        kernels.pack_nonfinite([(torch.ones(4), 0, 4), (None, 3, 2)], dst, impl="native")
    with pytest.raises(TypeError, match="float32"):
        kernels.pack_nonfinite([(torch.ones(4, dtype=torch.float64), 0, 4)], dst, impl="native")
    with pytest.raises(ValueError, match="contiguous"):
        kernels.pack_nonfinite([(torch.ones(8)[::2], 0, 4)], dst, impl="native")
    assert torch.equal(dst, torch.zeros(10))  # nothing written by a refused call


def test_native_library_releases_the_gil():
    # ctypes.CDLL drops the GIL for each foreign call; ctypes.PyDLL (a subclass) would keep it.
    import ctypes

    from commopt.kernels import native as _native_kernels

    lib = _native_kernels.load()
    assert isinstance(lib, ctypes.CDLL) and not isinstance(lib, ctypes.PyDLL)
    assert lib._func_flags_ & ctypes._FUNCFLAG_PYTHONAPI == 0
