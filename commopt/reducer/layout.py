"""Gradient buckets: which parameter's gradient lives where, in which flat buffer.

Every rank builds the same buckets in the same order from the same parameter list: each
bucket is homogeneous in (device, dtype, codec), holds up to ``bucket_cap_mb`` MiB of fp32
gradient, and in a compressed bucket every tensor starts at a multiple of the codec's
``alignment`` (a QSGD quantisation group never straddles two tensors).

    >>> import torch
    >>> from commopt.reducer.layout import build_buckets
    >>> ps = [torch.zeros(3), torch.zeros(5)]
    >>> [
    ...     (b.index, b.numel, [s.param for s in b.slots])
    ...     for b in build_buckets(ps, ["a", "b"], codec=None, plain_codec=None)
    ... ]
    [(0, 8, [1, 0])]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from commopt.codecs.base import Codec

__all__ = ["Bucket", "Slot", "build_buckets", "is_view_of", "slot_view"]


@dataclass(frozen=True)
class Slot:
    """Where one parameter's gradient lives in its bucket."""

    param: int  # index into the reducer's parameter list
    offset: int
    numel: int
    padded: int  # numel rounded up to the bucket codec's alignment


@dataclass
class Bucket:
    """A group of gradients reduced by one collective with one codec."""

    index: int
    codec: Codec | None  # None: exact, in ``dtype``
    compressed: bool
    device: torch.device
    dtype: torch.dtype
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0

    @property
    def key(self) -> str:
        # Names the bucket for stateful codecs; the size makes a changed layout a new key.
        return f"b{self.index}:{self.numel}"


def _flat_dtype(p: torch.Tensor) -> torch.dtype:
    if not p.is_floating_point():
        raise TypeError(f"gradients must be floating point; got a parameter of {p.dtype}")
    # Half-precision gradients are summed in fp32; fp64 stays fp64 (exact, uncompressed).
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def build_buckets(
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    *,
    codec: Codec | None,
    plain_codec: Codec | None,
    policy: Any = None,
    bucket_cap_mb: float = 25.0,
) -> list[Bucket]:
    """Assign parameters to buckets, last parameter first (roughly backward order).

    ``codec`` compresses the tensors ``policy.should_compress(name, shape)`` accepts;
    the rest use ``plain_codec`` (None: exact float32). Buckets are homogeneous in
    (device, dtype, codec) and hold up to ``bucket_cap_mb`` MiB of float32 gradient.
    """
    cap = max(1, int(bucket_cap_mb * 2**20))
    buckets: list[Bucket] = []
    open_: dict[tuple[str, torch.dtype, bool], Bucket] = {}
    order: list[tuple[str, torch.dtype, bool]] = []  # kinds in the order their buckets opened

    def close(kind: tuple[str, torch.dtype, bool]) -> None:
        b = open_.pop(kind)
        order.remove(kind)
        b.index = len(buckets)
        buckets.append(b)

    for i in reversed(range(len(params))):
        p = params[i]
        dtype = _flat_dtype(p)
        compress = (
            codec is not None
            and dtype == torch.float32
            and (policy is None or policy.should_compress(names[i], tuple(p.shape)))
        )
        chosen = codec if compress else (plain_codec if dtype == torch.float32 else None)
        kind = (str(p.device), dtype, compress)
        align = chosen.alignment if chosen is not None else 1
        padded = -(-p.numel() // align) * align
        b = open_.get(kind)
        if b is not None and b.numel and (b.numel + padded) * 4 > cap:
            close(kind)
            b = None
        if b is None:
            b = open_[kind] = Bucket(-1, chosen, compress, p.device, dtype)
            order.append(kind)
        b.slots.append(Slot(i, b.numel, p.numel(), padded))
        b.numel += padded
    while order:  # close() removes the kind from order: take them one by one, oldest first
        close(order[0])
    return buckets


def slot_view(flat: torch.Tensor, s: Slot, p: torch.Tensor) -> torch.Tensor:
    """The part of a bucket that holds parameter ``p``'s gradient, shaped like ``p``."""
    return flat[s.offset : s.offset + s.numel].view(p.shape)


def is_view_of(g: torch.Tensor | None, region: torch.Tensor) -> bool:
    """True when ``g`` is exactly ``region`` of a bucket (same memory, same elements)."""
    return (
        g is not None
        and g.data_ptr() == region.data_ptr()
        and g.numel() == region.numel()
        and g.dtype == region.dtype
        and g.device == region.device
        and g.is_contiguous()
    )
