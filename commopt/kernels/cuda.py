"""CUDA kernels of the codecs: ``commopt_ext/codec_kernels.cu`` compiled at run time by CuPy.

Called through :mod:`commopt.kernels` (which validates arguments). The module is compiled
lazily, once per device, on the first CUDA encode/decode, and kernels run on torch's
current stream. Needs ``pip install cupy-cuda12x``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from commopt.kernels import reference as _ref

SOURCE = Path(__file__).resolve().parents[2] / "commopt_ext" / "codec_kernels.cu"
#: flags for NVRTC: keep every float operation exactly as written in the source.
NVRTC_OPTIONS = ("--std=c++14", "--fmad=false", "--prec-div=true", "--prec-sqrt=true")

_modules: dict[int, object] = {}
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_THREADS = 256


def source_path() -> Path:
    """The .cu file (inside the installed commopt_ext package when there is one)."""
    import importlib.util

    spec = importlib.util.find_spec("commopt_ext")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / SOURCE.name
            if candidate.exists():
                return candidate
    return SOURCE


def _cupy():
    try:
        import cupy
    except ImportError as err:  # pragma: no cover - depends on the machine
        raise ImportError(
            "CUDA tensors need CuPy for commopt's codec kernels: pip install cupy-cuda12x "
            "(or pass impl='reference' to use plain torch)"
        ) from err
    return cupy


def _module(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    module = _modules.get(index)
    if module is None:
        cupy = _cupy()
        with cupy.cuda.Device(index):
            module = cupy.RawModule(code=source_path().read_text(), options=NVRTC_OPTIONS)
        _modules[index] = module
    return module


def _launch(device: torch.device, name: str, work_items: int, args: tuple) -> None:
    if work_items <= 0:
        return
    cupy = _cupy()
    kernel = _module(device).get_function(name)
    blocks = max(1, min((work_items + _THREADS - 1) // _THREADS, 65535 * 8))
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        kernel((blocks,), (_THREADS,), args)


def _ptr(t: torch.Tensor):
    import numpy as np

    return np.uint64(t.data_ptr())


def _args(*values):
    import numpy as np

    out = []
    for v in values:
        if isinstance(v, float):
            out.append(np.float32(v))
        elif isinstance(v, tuple):  # ("u32", value) / ("i64", value)
            kind, value = v
            out.append(np.uint32(value) if kind == "u32" else np.int64(value))
        else:
            out.append(np.int32(v) if not isinstance(v, np.generic) else v)
    return tuple(out)


def qsgd_encode(x, out, *, bits, levels, bucket_size, key, norm, stochastic, scale,
                scale_bytes) -> None:
    n = x.numel()
    nb = -(-n // bucket_size)
    head = nb * scale_bytes
    code_bytes = (n * bits + 7) // 8
    out[head + code_bytes:].zero_()
    if n == 0:
        return
    l2 = norm == "l2"
    k0, k1 = ("u32", key[0]), ("u32", key[1])
    if bucket_size * bits % 8 == 0 and bucket_size <= 1024:
        width = 1
        while width < bucket_size:
            width *= 2
        name = "qsgd_encode_warp4" if bucket_size <= 128 else "qsgd_encode_warp32"
        _launch(x.device, name, nb * 32, (_ptr(x), _ptr(out)) + _args(
            ("i64", n), bits, levels, bucket_size, int(l2), width, int(stochastic), k0, k1, scale,
            scale_bytes))
        return
    # General path: steps first (l2 norms of odd/large buckets through the torch spec).
    steps = torch.empty(nb, dtype=torch.float32, device=x.device)
    norms = None
    if l2:
        y = x * scale if scale != 1.0 else x
        padded = torch.nn.functional.pad(y, (0, nb * bucket_size - n)).view(nb, bucket_size)
        norms = _ref._bucket_norm(padded, "l2").contiguous()
    import numpy as np

    _launch(x.device, "qsgd_steps", nb * 32, (_ptr(x), _ptr(norms) if norms is not None else np.uint64(0),
                                              _ptr(out), _ptr(steps)) + _args(
        ("i64", n), levels, bucket_size, scale, scale_bytes))
    _launch(x.device, "qsgd_quantize_bytes", code_bytes, (_ptr(x), _ptr(steps), np.uint64(out.data_ptr() + head))
            + _args(("i64", n), bits, levels, bucket_size, int(stochastic), k0, k1, scale))


def qsgd_decode(wire, out, *, bits, levels, bucket_size, accumulate, alpha, scale_bytes) -> None:
    n = out.numel()
    _launch(out.device, "qsgd_decode", n, (_ptr(wire), _ptr(out)) + _args(
        ("i64", n), bits, bucket_size, scale_bytes, int(accumulate), alpha))


def cast_encode(x, out, *, scale) -> None:
    n = x.numel()
    _launch(x.device, "cast_encode", n, (_ptr(x), _ptr(out)) + _args(("i64", n), _DTYPE_CODE[out.dtype], scale))


def cast_decode(wire, out, *, accumulate, alpha) -> None:
    n = out.numel()
    _launch(out.device, "cast_decode", n, (_ptr(wire), _ptr(out)) + _args(
        ("i64", n), _DTYPE_CODE[wire.dtype], int(accumulate), alpha))
