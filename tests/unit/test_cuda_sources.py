"""Compile-check the CUDA kernel sources without a GPU: NVRTC (the nvidia-cuda-nvrtc-cu12
wheel) when installed, else nvcc when on PATH; skipped, saying so, when neither exists."""
from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys

import pytest

from commopt.kernels.cuda import NVRTC_OPTIONS, source_path

KERNELS = ("qsgd_encode_warp4", "qsgd_encode_warp32", "qsgd_steps", "qsgd_quantize_bytes",
           "qsgd_decode", "cast_encode", "cast_decode")


def _nvrtc():
    patterns = [os.path.join(p, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*") for p in sys.path if p]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if "alt" in os.path.basename(path) or "builtins" in os.path.basename(path):
                continue
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _nvrtc_compile(lib, source: str, options: tuple[str, ...]) -> tuple[int, str, bytes]:
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"codec_kernels.cu", 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram failed: {rc}"
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = b""
    if rc == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, buf)
        ptx = buf.value
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), ptx


def test_cuda_sources_compile():
    source = source_path().read_text()
    lib = _nvrtc()
    if lib is not None:
        for arch in ("compute_75", "compute_90"):
            rc, log, ptx = _nvrtc_compile(lib, source, NVRTC_OPTIONS + (f"--gpu-architecture={arch}",))
            assert rc == 0, f"NVRTC ({arch}) failed:\n{log}"
            assert "warning" not in log.lower(), log
            for name in KERNELS:
                assert f".entry {name}(".encode() in ptx, f"kernel {name} missing from the PTX"
        return
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("neither NVRTC (pip install nvidia-cuda-nvrtc-cu12) nor nvcc is available")
    out = subprocess.run([nvcc, "-arch=sm_90", "--fmad=false", "-ptx", "-o", os.devnull, str(source_path())],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
