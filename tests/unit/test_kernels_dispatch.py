"""How commopt.kernels picks an implementation, and its argument checks."""

from __future__ import annotations

import sys

import pytest
import torch

from commopt import kernels
from commopt.kernels import native as _native_kernels


def test_cpu_tensors_use_native_when_built():
    x = torch.randn(10)
    assert kernels._pick(None, x) == ("native" if kernels.native_available() else "reference")
    assert kernels._pick("reference", x) == "reference"


def test_bad_impl_and_device_requests_raise():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="impl must be one of"):
        kernels._pick("fast", x)
    with pytest.raises(ValueError, match="impl must be one of"):
        kernels._pick("cuda", x)  # the raw CUDA path is gone: CUDA tensors use triton
    meta = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="one device"):
        kernels._pick(None, x, meta)


def test_missing_triton_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "commopt.kernels.triton", None)  # makes the import fail
    monkeypatch.delattr(kernels, "triton", raising=False)
    with pytest.raises(ImportError, match=r"pip install triton==3\.7\.1"):
        kernels._triton()


def test_environment_variable_picks_the_cpu_implementation(monkeypatch):
    x = torch.randn(10)
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert kernels._pick(None, x) == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="COMMOPT_KERNELS='fastest'"):
        kernels._pick(None, x)
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    if kernels.triton_interpreted():
        assert kernels._pick(None, x) == "triton"
    else:  # a GPU machine: CPU tensors need the interpreter, set before triton's import
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            kernels._pick(None, x)


def test_missing_native_library_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(kernels, "native_available", lambda: False)
    monkeypatch.setattr(kernels, "_warned_no_native", False)
    x = torch.randn(300)
    wire = torch.empty(kernels.qsgd_nbytes(300, bits=4, bucket_size=128), dtype=torch.uint8)
    with pytest.warns(RuntimeWarning, match="build_ext"):
        kernels.qsgd_encode(x, wire, bits=4, levels=7, bucket_size=128, key=(1, 1))
    with pytest.raises(RuntimeError, match="build_ext"):
        kernels.qsgd_encode(x, wire, bits=4, levels=7, bucket_size=128, key=(1, 1), impl="native")


@pytest.mark.skipif(not kernels.native_available(), reason="native library not built")
def test_abi_version_is_checked():
    assert _native_kernels.load().commopt_abi_version() == _native_kernels.ABI_VERSION


def test_argument_checks():
    x = torch.randn(10)
    wire = torch.empty(kernels.qsgd_nbytes(10, bits=4, bucket_size=4), dtype=torch.uint8)
    with pytest.raises(ValueError, match="levels"):
        kernels.qsgd_encode(x, wire, bits=4, levels=8, bucket_size=4, key=(0, 0))
    with pytest.raises(ValueError, match="expected"):
        kernels.qsgd_encode(x, wire[:-4], bits=4, levels=7, bucket_size=4, key=(0, 0))
    with pytest.raises(ValueError, match="norm"):
        kernels.qsgd_encode(x, wire, bits=4, levels=7, bucket_size=4, key=(0, 0), norm="l1")
    with pytest.raises(TypeError, match="dtype"):
        kernels.cast_encode(x, torch.empty(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="elements"):
        kernels.cast_decode(torch.empty(9, dtype=torch.float16), x)
