"""The communication plan, in the optimizer's own words: ``algorithm``, ``compression``,
``bucket_cap_mb``, ``overlap`` and ``double_buffering`` mean what they mean to
``commopt.create_multi_node_optimizer``; ``piece_mb`` (the pipeline's piece size) and
``copy_passes`` (gradient-sized copies the software makes) are the simulator's own.

    >>> Configuration(compression="fp16", double_buffering=True).compression.name
    'fp16'
    >>> Configuration(compression="qsgd4").piece_mb  # commopt.collectives.PIECE_BYTES, in MiB
    4.0
    >>> Configuration(algorithm="ring", compression="qsgd4")
    Traceback (most recent call last):
    ...
    ValueError: codec qsgd4 is not linear: a ring or tree would decode and re-encode at every hop; use algorithm scatter_reduce or hierarchical (or auto)

One JSON configuration serves both the simulator and the optimizer:

    >>> Configuration.from_config({"compression": "qsgd4", "double_buffering": True}).describe()
    'auto, codec qsgd4, 25 MB buckets, pieces of 4 MiB, overlap double-buffering'

``commopt simulate --config FILE`` reads it and ``create_multi_node_optimizer(opt, comm,
**json.load(open(FILE)))`` takes the same keys (:data:`CONFIG_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from commopt.sim.codec_costs import CodecCost, get_codec_cost
from commopt.sim.comm_model import SRA_PIECE_BYTES

#: The optimizer's algorithms (commopt.collectives.ALGORITHMS, less ``identity``: a world of
#: one, no communication) and two the simulator adds: ``ring`` and ``tree`` pin ``native`` to
#: one of NCCL's own algorithms.
ALGORITHMS = ("auto", "native", "scatter_reduce", "hierarchical", "ring", "tree")
#: The keys of a shared configuration: parameters of create_multi_node_optimizer. The last
#: three do not change the predicted step time and are accepted so that one file serves both.
CONFIG_KEYS = (
    "algorithm",
    "compression",
    "allreduce_grad_dtype",
    "bucket_cap_mb",
    "overlap",
    "double_buffering",
    "zero_fill",
    "seed",
    "clip_grad_norm",
)
#: Earlier spellings, and what to write instead.
RENAMED = {
    "codec": "compression",
    "bucket_mb": "bucket_cap_mb",
    "sra": "scatter_reduce",
    "nccl": "native",
    "overlap='none'": "overlap=False",
    "overlap='backward'": "overlap=True",
    "overlap='double-buffering'": "double_buffering=True",
}
#: Piece size of the scatter-reduce pipeline in MiB (commopt.collectives.PIECE_BYTES).
DEFAULT_PIECE_MB = SRA_PIECE_BYTES / 2**20
_GRAD_DTYPES = {"float32": "none", "float16": "fp16", "bfloat16": "bf16"}


def config_fields(config: dict) -> dict:
    """The :class:`Configuration` fields a ``create_multi_node_optimizer`` configuration sets (the keys
    of :data:`CONFIG_KEYS` it holds). ``allreduce_grad_dtype`` stands for the codec where
    ``compression`` is absent or None, as in the optimizer; error feedback (``+ef``) keeps the
    codec's wire format and its residual's passes over the gradient are not modelled.

        >>> config_fields({"compression": "qsgd4+ef", "bucket_cap_mb": 50, "seed": 1})
        {'bucket_cap_mb': 50, 'compression': 'qsgd4'}
    """
    if not isinstance(config, dict):
        raise ValueError(f"a configuration is a JSON object, got {type(config).__name__}")
    for key in config:
        if key in RENAMED:
            raise ValueError(f"configuration key {key!r} is now called {RENAMED[key]!r}")
        if key not in CONFIG_KEYS:
            raise ValueError(
                f"configuration key {key!r} is not an option of create_multi_node_optimizer "
                f"that the simulator reads; keys: {', '.join(CONFIG_KEYS)}"
            )
    plan_keys = ("algorithm", "bucket_cap_mb", "overlap", "double_buffering")
    out = {k: config[k] for k in plan_keys if k in config}
    compression = config.get("compression")
    if isinstance(compression, str):
        out["compression"] = compression.removesuffix("+ef")
    elif compression is not None:
        raise ValueError(f"compression must be a codec name such as 'qsgd4', got {compression!r}")
    elif config.get("allreduce_grad_dtype") is not None:
        dtype = config["allreduce_grad_dtype"]
        if dtype not in _GRAD_DTYPES:
            raise ValueError(
                f"allreduce_grad_dtype must be one of {', '.join(_GRAD_DTYPES)}, got {dtype!r}"
            )
        out["compression"] = _GRAD_DTYPES[dtype]
    return out


def _check_algorithm(algorithm: str) -> None:
    if algorithm in ALGORITHMS:
        return
    if algorithm in RENAMED:
        raise ValueError(f"algorithm {algorithm!r} is now called {RENAMED[algorithm]!r}")
    if algorithm == "identity":
        raise ValueError(
            "algorithm 'identity' is a world of one (no communication): simulate --gpus 1"
        )
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def _check_overlap(overlap) -> None:
    if isinstance(overlap, bool):
        return
    if isinstance(overlap, str) and f"overlap={overlap!r}" in RENAMED:
        raise ValueError(
            f"overlap={overlap!r} is now {RENAMED[f'overlap={overlap!r}']} (the optimizer's "
            "options: overlap=True/False, double_buffering=True/False/'compensated')"
        )
    raise ValueError(f"overlap must be True or False, got {overlap!r}")


@dataclass(frozen=True, init=False)
class Configuration:
    algorithm: str
    compression: CodecCost
    bucket_cap_mb: float
    overlap: bool
    double_buffering: bool | str
    piece_mb: float
    copy_passes: float

    def __init__(
        self,
        algorithm: str = "auto",
        compression: str | CodecCost | None = "none",
        bucket_cap_mb: float = 25.0,
        overlap: bool = True,
        double_buffering: bool | str = False,
        piece_mb: float = DEFAULT_PIECE_MB,
        copy_passes: float = 0.0,
        **renamed,
    ):
        if renamed:
            name = next(iter(renamed))
            new = RENAMED.get(name)
            raise TypeError(
                f"Configuration() got an unexpected keyword argument {name!r}"
                + (f"; it is now called {new!r}" if new else "")
            )
        _check_algorithm(algorithm)
        _check_overlap(overlap)
        if double_buffering not in (False, True, "compensated"):
            raise ValueError(
                f"double_buffering must be False, True or 'compensated', got {double_buffering!r}"
            )
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 MB, got {bucket_cap_mb}")
        if not copy_passes >= 0:
            raise ValueError(
                f"copy passes must be >= 0 (gradient-sized copies per step), got {copy_passes}"
            )
        if not piece_mb >= 0:
            raise ValueError(f"piece size must be >= 0 MiB (0: no pipeline), got {piece_mb}")
        codec = get_codec_cost("none" if compression is None else compression)
        if algorithm in ("ring", "tree", "native") and not codec.linear:
            raise ValueError(
                f"codec {codec.name} is not linear: a ring or tree would decode and re-encode "
                "at every hop; use algorithm scatter_reduce or hierarchical (or auto)"
            )
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "compression", codec)
        object.__setattr__(self, "bucket_cap_mb", float(bucket_cap_mb))
        object.__setattr__(self, "overlap", overlap)
        object.__setattr__(self, "double_buffering", double_buffering)
        object.__setattr__(self, "piece_mb", float(piece_mb))
        object.__setattr__(self, "copy_passes", float(copy_passes))

    @classmethod
    def from_config(cls, config: dict, **simulator_only) -> Configuration:
        """The plan of a ``create_multi_node_optimizer`` configuration (:func:`config_fields`);
        ``simulator_only``: ``piece_mb``, ``copy_passes``."""
        return cls(**config_fields(config), **simulator_only)

    def config(self) -> dict:
        """This plan as ``create_multi_node_optimizer`` keywords (without the simulator's own
        ``piece_mb`` and ``copy_passes``)."""
        return {
            "algorithm": self.algorithm,
            "compression": self.compression.name,
            "bucket_cap_mb": self.bucket_cap_mb,
            "overlap": self.overlap,
            "double_buffering": self.double_buffering,
        }

    @property
    def schedule(self) -> str:
        """When the all-reduce runs: ``none`` (after the backward pass), ``backward`` (bucket by
        bucket during it) or ``double-buffering`` (during the next step)."""
        if self.double_buffering:
            return "double-buffering"
        return "backward" if self.overlap else "none"

    def with_(self, **changes) -> Configuration:
        """A copy with some fields changed: ``plan.with_(bucket_cap_mb=50)``."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            name = sorted(unknown)[0]
            new = RENAMED.get(name)
            raise TypeError(
                f"Configuration has no field(s) {', '.join(sorted(unknown))}"
                + (f"; {name!r} is now called {new!r}" if new else "")
            )
        return replace(self, **changes)  # through __init__: the changed plan is validated too

    def candidates(self) -> tuple[str, ...]:
        """The algorithms to try: ``auto`` takes, bucket by bucket, the fastest of those that
        suit the codec (as NCCL's tuner picks by message size); ``native`` the fastest of
        NCCL's own, ring and tree."""
        if self.algorithm == "native":  # what NCCL itself chooses between (no hierarchical ring)
            return ("ring", "tree")
        if self.algorithm != "auto":
            return (self.algorithm,)
        if self.compression.linear:
            return ("ring", "tree", "hierarchical")
        return ("scatter_reduce", "hierarchical")

    def describe(self) -> str:
        pieces = "" if self.compression.linear else f", pieces of {self.piece_mb:g} MiB"
        buckets = (
            "one buffer"
            if self.bucket_cap_mb == float("inf")
            else f"{self.bucket_cap_mb:g} MB buckets"
        )
        copies = f", {self.copy_passes:g} gradient copies" if self.copy_passes else ""
        schedule = self.schedule
        if self.double_buffering == "compensated":
            schedule += " (compensated)"
        return (
            f"{self.algorithm}, codec {self.compression.name}, {buckets}{pieces}, "
            f"overlap {schedule}{copies}"
        )
