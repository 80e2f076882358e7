"""Checks and typed views of uint8 wire buffers shared by the codecs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from commopt.codecs.base import Codec


def check_wire(codec: Codec, wire: torch.Tensor, numel: int, what: str) -> None:
    """Raise a clear error unless ``wire`` is a contiguous uint8 buffer of the exact size."""
    if wire.dtype != torch.uint8:
        raise TypeError(f"{codec.name}: the {what} buffer must be uint8, got {wire.dtype}")
    if not wire.is_contiguous():
        raise ValueError(f"{codec.name}: the {what} buffer must be contiguous")
    expected = codec.encoded_nbytes(numel)
    if wire.numel() != expected:
        raise ValueError(
            f"{codec.name}: the {what} buffer has {wire.numel()} bytes but {numel} elements need "
            f"{expected}; allocate it with codec.encoded_nbytes(numel)"
        )


def check_values(codec: Codec, t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as a flat float32 view; raises unless it is a contiguous float32 tensor."""
    if t.dtype != torch.float32:
        raise TypeError(f"{codec.name}: {what} must be float32, got {t.dtype} (convert it first)")
    if not t.is_contiguous():
        raise ValueError(f"{codec.name}: {what} must be contiguous (call .contiguous())")
    return t.view(-1)


def typed_view(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``wire`` viewed as ``dtype`` when its offset allows, else None (caller copies)."""
    size = torch.empty((), dtype=dtype).element_size()
    if wire.storage_offset() % size or wire.data_ptr() % size:
        return None
    return wire.view(dtype)
