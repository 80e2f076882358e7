"""The communication plan: algorithm, codec, bucket size and overlap.

    >>> Plan(codec="fp16", overlap="double-buffering").codec.name
    'fp16'
    >>> Plan(algorithm="ring", codec="qsgd4")
    Traceback (most recent call last):
    ...
    ValueError: codec qsgd4 is not linear: a ring or tree would decode and re-encode at every hop; use --algorithm sra or hierarchical (or auto)
"""
from __future__ import annotations

from dataclasses import dataclass

from commopt.sim.codec_costs import CodecCost, get_codec

ALGORITHMS = ("auto", "ring", "tree", "hierarchical", "sra")
OVERLAPS = ("none", "backward", "double-buffering")


@dataclass(frozen=True, init=False)
class Plan:
    algorithm: str
    codec: CodecCost
    bucket_mb: float
    overlap: str

    def __init__(self, algorithm: str = "auto", codec: str | CodecCost = "none",
                 bucket_mb: float = 25.0, overlap: str = "backward"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if overlap not in OVERLAPS:
            raise ValueError(f"unknown overlap {overlap!r}; choose one of {', '.join(OVERLAPS)}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket size must be > 0 MB, got {bucket_mb}")
        codec = get_codec(codec)
        if algorithm in ("ring", "tree") and not codec.linear:
            raise ValueError(f"codec {codec.name} is not linear: a ring or tree would decode and re-encode "
                             "at every hop; use --algorithm sra or hierarchical (or auto)")
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "codec", codec)
        object.__setattr__(self, "bucket_mb", float(bucket_mb))
        object.__setattr__(self, "overlap", overlap)

    def candidates(self) -> tuple[str, ...]:
        """The algorithms to try: ``auto`` takes, bucket by bucket, the fastest of those that
        suit the codec (as NCCL's tuner picks by message size)."""
        if self.algorithm != "auto":
            return (self.algorithm,)
        return ("ring", "tree", "hierarchical") if self.codec.linear else ("sra", "hierarchical")

    def describe(self) -> str:
        return f"{self.algorithm}, codec {self.codec.name}, {self.bucket_mb:g} MB buckets, overlap {self.overlap}"
