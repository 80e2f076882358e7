"""The communication plan: algorithm, codec, bucket size, overlap, and the piece size of the
pipelined scatter-reduce/allgather.

    >>> Plan(codec="fp16", overlap="double-buffering").codec.name
    'fp16'
    >>> Plan(codec="qsgd4").piece_mb  # commopt.collectives.PIECE_BYTES, in MiB
    4.0
    >>> Plan(algorithm="ring", codec="qsgd4")
    Traceback (most recent call last):
    ...
    ValueError: codec qsgd4 is not linear: a ring or tree would decode and re-encode at every hop; use --algorithm sra or hierarchical (or auto)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from commopt.sim.codec_costs import CodecCost, get_codec_cost
from commopt.sim.comm_model import SRA_PIECE_BYTES

ALGORITHMS = ("auto", "nccl", "ring", "tree", "hierarchical", "sra")
OVERLAPS = ("none", "backward", "double-buffering")
#: Piece size of the scatter-reduce pipeline in MiB (commopt.collectives.PIECE_BYTES).
DEFAULT_PIECE_MB = SRA_PIECE_BYTES / 2**20


@dataclass(frozen=True, init=False)
class Plan:
    algorithm: str
    codec: CodecCost
    bucket_mb: float
    overlap: str
    piece_mb: float
    copy_passes: float

    def __init__(
        self,
        algorithm: str = "auto",
        codec: str | CodecCost = "none",
        bucket_mb: float = 25.0,
        overlap: str = "backward",
        piece_mb: float = DEFAULT_PIECE_MB,
        copy_passes: float = 0.0,
    ):
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}"
            )
        if overlap not in OVERLAPS:
            raise ValueError(f"unknown overlap {overlap!r}; choose one of {', '.join(OVERLAPS)}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket size must be > 0 MB, got {bucket_mb}")
        if not copy_passes >= 0:
            raise ValueError(
                f"copy passes must be >= 0 (gradient-sized copies per step), got {copy_passes}"
            )
        if not piece_mb >= 0:
            raise ValueError(f"piece size must be >= 0 MiB (0: no pipeline), got {piece_mb}")
        codec = get_codec_cost(codec)
        if algorithm in ("ring", "tree") and not codec.linear:
            raise ValueError(
                f"codec {codec.name} is not linear: a ring or tree would decode and re-encode "
                "at every hop; use --algorithm sra or hierarchical (or auto)"
            )
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "codec", codec)
        object.__setattr__(self, "bucket_mb", float(bucket_mb))
        object.__setattr__(self, "overlap", overlap)
        object.__setattr__(self, "piece_mb", float(piece_mb))
        object.__setattr__(self, "copy_passes", float(copy_passes))

    def with_(self, **changes) -> Plan:
        """A copy with some fields changed: ``plan.with_(bucket_mb=50)``."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"Plan has no field(s) {', '.join(sorted(unknown))}")
        return replace(self, **changes)  # through __init__: the changed plan is validated too

    def candidates(self) -> tuple[str, ...]:
        """The algorithms to try: ``auto`` takes, bucket by bucket, the fastest of those that
        suit the codec (as NCCL's tuner picks by message size); ``nccl`` the fastest of NCCL's
        own, ring and tree."""
        if self.algorithm == "nccl":  # what NCCL itself chooses between (no hierarchical ring)
            return ("ring", "tree") if self.codec.linear else ("sra",)
        if self.algorithm != "auto":
            return (self.algorithm,)
        return ("ring", "tree", "hierarchical") if self.codec.linear else ("sra", "hierarchical")

    def describe(self) -> str:
        pieces = "" if self.codec.linear else f", pieces of {self.piece_mb:g} MiB"
        buckets = (
            "one buffer" if self.bucket_mb == float("inf") else f"{self.bucket_mb:g} MB buckets"
        )
        copies = f", {self.copy_passes:g} gradient copies" if self.copy_passes else ""
        return f"{self.algorithm}, codec {self.codec.name}, {buckets}{pieces}, overlap {self.overlap}{copies}"
