"""The Codec contract: how a flat fp32 gradient chunk is written on the wire and read back.

A codec turns ``x`` (contiguous, 1-D, float32) into a wire buffer of exactly
``encoded_nbytes(x.numel())`` bytes and back. ``decode`` is fused with accumulation so a
reduction never materialises a decoded copy.

    >>> import torch
    >>> from commopt.codecs import get_codec
    >>> codec = get_codec("fp16")
    >>> x = torch.tensor([1.0, -2.0, 0.5])
    >>> wire = torch.empty(codec.encoded_nbytes(x.numel()), dtype=torch.uint8)
    >>> codec.encode(x, wire)
    >>> out = torch.zeros(3)
    >>> codec.decode(wire, out, accumulate=True)
    >>> out.tolist()
    [1.0, -2.0, 0.5]

``linear`` codecs (fp32/fp16/bf16 casts) produce wires that a transport may sum
element-wise as ``wire.view(codec.wire_dtype)``; the others (QSGD) must be decoded before
they are added (the scatter-reduce/allgather algorithm in commopt.collectives does that).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RngKey:
    """Where the random numbers of one ``encode`` come from.

    Stochastic rounding draws from a counter-based generator keyed by
    (seed, rank, reduction, stream) and counted by bucket and element, so a run is
    reproducible and independent of threads, kernels and chunking. ``reduction`` is the
    reduction number; ``stream`` tells apart the encodes of one reduction (e.g. the bucket id
    and the chunk index) so that they do not share numbers.
    """

    seed: int
    rank: int
    reduction: int
    stream: int = 0


class Codec(ABC):
    """Encoder/decoder of flat fp32 buffers. Subclasses set the class attributes below."""

    #: short name, as accepted by ``get_codec`` (e.g. "fp16", "qsgd4").
    name: str = "codec"
    #: True when encoded buffers of several ranks may be summed element-wise by a transport.
    linear: bool = False
    #: dtype of the wire as a typed tensor for linear codecs (None: opaque bytes).
    wire_dtype: torch.dtype | None = None
    #: chunks handed to ``encode`` should start at multiples of this many elements, so
    #: that splitting a buffer (e.g. per peer) does not change how it is encoded.
    alignment: int = 1
    #: True when ``encode`` draws random numbers (needs an ``rng`` key to be reproducible).
    stochastic: bool = False
    #: True when a decoded result can hold NaN/Inf although every rank's input was finite:
    #: reductions through such a codec re-check their result, so the step's NaN/Inf agreement
    #: sees it. A narrow wire dtype or scales that overflow do that; so does a wire damaged on
    #: the way or sent by a faulty peer (wire bytes are untrusted: a few bytes of a scale or a
    #: float turn into NaN), hence True unless a codec's decode can never write NaN/Inf.
    can_overflow: bool = True

    @abstractmethod
    def encoded_nbytes(self, numel: int) -> int:
        """Exact size in bytes of the wire for ``numel`` fp32 elements."""

    @abstractmethod
    def encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        scale: float = 1.0,
        rng: RngKey | None = None,
        key: Hashable | None = None,
    ) -> None:
        """Write ``x * scale`` into the uint8 buffer ``out`` (``encoded_nbytes`` bytes).

        ``scale`` is applied before any rounding (divide by the world size here so a
        16-bit sum cannot overflow). ``key`` names the tensor/bucket for stateful codecs
        (error feedback keeps its residual under it); stateless codecs ignore it.
        """

    @abstractmethod
    def decode(self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False) -> None:
        """Write (``accumulate=False``) or add (``True``) the decoded values into fp32 ``out``."""

    def decode_scaled(
        self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0
    ) -> None:
        """Like ``decode`` but writes/adds ``alpha * decoded`` (error feedback uses ``-1``).

        Codecs with fused kernels override this; the default decodes into a temporary.
        """
        if alpha == 1.0:
            self.decode(wire, out, accumulate=accumulate)
            return
        tmp = torch.empty_like(out)
        self.decode(wire, tmp, accumulate=False)
        if accumulate:
            out.add_(tmp, alpha=alpha)
        else:
            torch.mul(tmp, alpha, out=out)

    def decode_own(
        self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, alpha: float = 1.0
    ) -> None:
        """``decode_scaled`` of a wire that this codec's own ``encode`` has just written in this
        process (error feedback reads back what it sent): the bytes never left the process, so
        a codec may skip the checks it runs on a wire from a peer. Same values as
        ``decode_scaled``."""
        self.decode_scaled(wire, out, accumulate=accumulate, alpha=alpha)

    # Stateful codecs (error feedback) override these; the state is plain tensors.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"codec {self.name} has no state, got keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
