"""What a codec costs the simulator: bytes on the wire and time to encode and decode.

Sizes follow commopt's own codecs (QSGD: ``bits`` per element plus one float32 scale per
bucket of ``bucket_size`` elements). Speeds come from a measurement when one is given (the
codec benchmark's GB/s of float32 input) and otherwise from a memory-bound model: a codec
kernel streams ``*_bytes_per_elem`` bytes per element at half the device's memory bandwidth
(an assumption; replace it with measured numbers via :func:`from_benchmark`).

    >>> c = get_codec_cost("qsgd4")
    >>> c.wire_bytes(1024, grad_bytes=4) / (1024 * 4)
    0.1328125
    >>> get_codec_cost("fp16").wire_bytes(1000, grad_bytes=4)
    2000.0
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace

MEMORY_EFFICIENCY = 0.5  # assumption: codec kernels stream at half the spec memory bandwidth


@dataclass(frozen=True)
class CodecCost:
    name: str
    linear: bool  # may partial sums be added in wire format (ring, tree)?
    wire_bits: float | None  # bits per element on the wire; None: the gradient's dtype
    bucket_size: int = 0  # elements sharing one scale
    scale_bytes: int = 0
    encode_bytes_per_elem: float = 0.0  # memory traffic per element, beyond the wire bytes
    decode_bytes_per_elem: float = 0.0
    encode_elems_per_s: float | None = None  # measured speeds override the memory model
    decode_elems_per_s: float | None = None
    bytes_ratio: float | None = None  # measured wire bytes / float32 bytes, overrides wire_bits

    def wire_bytes(self, numel: float, grad_bytes: int) -> float:
        if self.bytes_ratio is not None:
            return numel * 4 * self.bytes_ratio
        if self.wire_bits is None:
            return float(numel * grad_bytes)
        scales = math.ceil(numel / self.bucket_size) * self.scale_bytes if self.bucket_size else 0
        return numel * self.wire_bits / 8 + scales

    def is_identity(self, grad_bytes: int) -> bool:
        """True when encoding does nothing (no codec, or a cast to the gradient's own width)."""
        return self.wire_bits is None or (
            self.linear and self.wire_bits == 8 * grad_bytes and self.bytes_ratio is None
        )

    def encode_s(self, numel: float, memory_GBps: float, grad_bytes: int) -> float:
        if numel <= 0 or self.is_identity(grad_bytes):
            return 0.0
        if self.encode_elems_per_s:
            return numel / self.encode_elems_per_s
        traffic = numel * (self.encode_bytes_per_elem + grad_bytes) + self.wire_bytes(
            numel, grad_bytes
        )
        return traffic / (memory_GBps * 1e9 * MEMORY_EFFICIENCY)

    def decode_s(self, numel: float, memory_GBps: float, grad_bytes: int) -> float:
        if numel <= 0 or self.is_identity(grad_bytes):
            return 0.0
        if self.decode_elems_per_s:
            return numel / self.decode_elems_per_s
        traffic = numel * (self.decode_bytes_per_elem + grad_bytes) + self.wire_bytes(
            numel, grad_bytes
        )
        return traffic / (memory_GBps * 1e9 * MEMORY_EFFICIENCY)


NONE = CodecCost("none", linear=True, wire_bits=None)


def _qsgd(bits: int, bucket: int = 128) -> CodecCost:
    # encode reads the gradient twice (scale pass, quantise pass); decode adds into the
    # output (one more read of it).
    return CodecCost(
        f"qsgd{bits}" + ("" if bucket == 128 else f"b{bucket}"),
        linear=False,
        wire_bits=float(bits),
        bucket_size=bucket,
        scale_bytes=4,
        encode_bytes_per_elem=4.0,
        decode_bytes_per_elem=4.0,
    )


PRESETS: dict[str, CodecCost] = {
    "none": NONE,
    "fp16": CodecCost("fp16", linear=True, wire_bits=16.0),
    "bf16": CodecCost("bf16", linear=True, wire_bits=16.0),
    "qsgd2": _qsgd(2),
    "qsgd4": _qsgd(4),
    "qsgd8": _qsgd(8),
}


def list_codec_costs() -> list[str]:
    return list(PRESETS) + ["qsgd<bits>b<bucket> (e.g. qsgd4b1024)"]


def get_codec_cost(name: str | CodecCost) -> CodecCost:
    """A codec by name: none, fp16, bf16, qsgd2/4/8 or qsgd<bits>b<bucket>."""
    if isinstance(name, CodecCost):
        return name
    if name in PRESETS:
        return PRESETS[name]
    m = re.fullmatch(r"qsgd(\d+)b(\d+)", name)
    if m and int(m.group(1)) in (2, 4, 8) and int(m.group(2)) >= 1:
        return _qsgd(int(m.group(1)), int(m.group(2)))
    raise ValueError(f"unknown codec {name!r}; choose one of: {', '.join(list_codec_costs())}")


def _codec_perf_rows(cpu: dict) -> list[dict]:
    """Entries from ``benchmarks/codec_perf.py --json``: its CPU rows of native kernels, named
    as the simulator's codecs (commopt's QSGD default is max scale, stochastic rounding)."""
    out = []
    for row in cpu.get("rows", []):
        label = str(row.get("codec", ""))
        m = re.fullmatch(r"qsgd(\d+) b(\d+) max stochastic", label)
        if m:
            name = f"qsgd{m.group(1)}" + ("" if m.group(2) == "128" else f"b{m.group(2)}")
        elif label in ("fp16", "bf16"):
            name = label
        else:
            continue
        if "native_encode" in row and "native_decode" in row:
            entry = {
                "codec": name,
                "encode_GBps": row["native_encode"],
                "decode_GBps": row["native_decode"],
            }
            if m and row.get("wire_ratio") is not None:  # a cast's width is exact already
                entry["bytes_ratio"] = row["wire_ratio"]
            out.append(entry)
    return out


def _entries(data) -> list[dict]:
    if isinstance(data, dict) and isinstance(data.get("cpu"), dict):
        return _codec_perf_rows(data["cpu"])
    if isinstance(data, dict) and "results" in data:
        data = data["results"]
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise ValueError(
            "codec benchmark file must hold an object, a list of objects, or {'results': [...]}"
        )
    return data


def from_benchmark(source: str | dict | list, codec: str | CodecCost) -> CodecCost:
    """``codec`` with the speeds (and bytes ratio) measured by the codec benchmark.

    ``source`` is a JSON file or its parsed content: the output of ``benchmarks/codec_perf.py
    --json`` (its CPU rows of native kernels), or one entry, a list, or ``{"results": [...]}``;
    an entry is ``{"codec": "qsgd4", "bytes_ratio": 0.133, "encode_GBps": 40.0,
    "decode_GBps": 60.0}`` with GB/s counted in float32 input bytes.

        >>> c = from_benchmark({"codec": "qsgd4", "encode_GBps": 4.0, "decode_GBps": 8.0}, "qsgd4")
        >>> c.encode_s(1e9, memory_GBps=900, grad_bytes=4)  # 4 GB at 4 GB/s
        1.0
    """
    base = get_codec_cost(codec)
    if isinstance(source, str):
        if not os.path.exists(source):
            raise FileNotFoundError(f"codec benchmark file {source!r} does not exist")
        with open(source) as f:
            source = json.load(f)
    entries = [e for e in _entries(source) if e.get("codec", e.get("name")) == base.name]
    if not entries:
        raise ValueError(f"the codec benchmark results have no entry for codec {base.name!r}")
    e = entries[0]
    try:
        enc = float(e["encode_GBps"]) * 1e9 / 4
        dec = float(e["decode_GBps"]) * 1e9 / 4
    except KeyError as exc:
        raise ValueError(f"codec benchmark entry for {base.name!r} lacks {exc.args[0]!r}") from exc
    if enc <= 0 or dec <= 0:
        raise ValueError(f"codec benchmark speeds must be > 0 GB/s, got {e}")
    ratio = e.get("bytes_ratio")
    return replace(
        base,
        encode_elems_per_s=enc,
        decode_elems_per_s=dec,
        bytes_ratio=None if ratio is None else float(ratio),
        linear=bool(e.get("linear", base.linear)),
    )
