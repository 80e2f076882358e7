"""Which tensors are compressed: the per-layer policy.

Small and one-dimensional tensors (biases, normalisation weights) carry little traffic but
are sensitive to quantisation noise, so they travel uncompressed: as float32, or in the
cast dtype (``uncompressed="fp16"``). Defaults and their sources:

* ``min_compress_numel=1024`` and ``compress_1d=False``: the released torch_cgx (CGX, IST
  Austria) leaves tensors with ``dim <= 1`` or fewer than 1024 elements uncompressed
  (published, in torch_cgx's source).
* ``exclude``: regular expressions (``re.search`` on the parameter name); by default biases
  and normalisation layers, mirroring the LARS rule that skips bias and batch-norm
  parameters (published MLPerf reference). These are 1-D in common models, so the pattern
  only matters for unusual shapes.

Quantisation groups never straddle two tensors: the reducer's bucket layout
(``commopt.reducer.layout``) places each tensor of a flat buffer at a multiple of the codec's
``alignment``.

    >>> policy = CompressionPolicy()
    >>> policy.should_compress("layer1.conv.weight", (64, 64, 3, 3))
    True
    >>> policy.should_compress("layer1.bn.weight", (64,))
    False
    >>> policy.should_compress("fc.weight", (10, 50))  # 500 < 1024 elements
    False
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_MIN_COMPRESS_NUMEL = 1024
DEFAULT_EXCLUDE = (r"(^|\.)bias$", r"(^|\.)(bn|batchnorm|norm|ln|layernorm|layer_norm)[^.]*\.")


@dataclass(frozen=True)
class CompressionPolicy:
    """Decide per named tensor whether the compressing codec applies."""

    min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL
    exclude: Sequence[str] = field(default=DEFAULT_EXCLUDE)
    compress_1d: bool = False
    #: codec name for the tensors left out: "none" (float32), "fp16" or "bf16".
    uncompressed: str = "none"

    def __post_init__(self) -> None:
        if self.min_compress_numel < 0:
            raise ValueError(f"min_compress_numel must be >= 0, got {self.min_compress_numel}")
        if isinstance(self.exclude, str):
            raise TypeError(
                "exclude must be a sequence of patterns, e.g. (r'bias$',), not a string"
            )
        patterns = []
        for pattern in self.exclude:
            try:
                patterns.append(re.compile(pattern))
            except re.error as err:
                raise ValueError(
                    f"exclude pattern {pattern!r} is not a valid regex: {err}"
                ) from None
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "_patterns", tuple(patterns))
        if self.uncompressed not in ("none", "fp32", "fp16", "bf16"):
            raise ValueError(
                f"uncompressed must be 'none', 'fp16' or 'bf16', got {self.uncompressed!r}"
            )

    def should_compress(self, name: str, shape: Iterable[int]) -> bool:
        """True when the tensor ``name`` of ``shape`` goes through the compressing codec."""
        shape = tuple(int(s) for s in shape)
        if len(shape) <= 1 and not self.compress_1d:
            return False
        if math.prod(shape) < self.min_compress_numel:
            return False
        patterns: tuple[re.Pattern[str], ...] = self.__dict__["_patterns"]  # see __post_init__
        return not any(p.search(name) for p in patterns)
