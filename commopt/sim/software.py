"""What named training software did with the gradients: overlap, buffers, copies, wire dtype.

A :class:`Software` preset turns into a :class:`~commopt.sim.configuration.Configuration`: when its all-reduce
starts (after the backward pass, during it bucket by bucket, or one step later with double
buffering), how the gradients are grouped (``bucket_cap_mb``; ``math.inf``: one buffer of all of
them), how many gradient-sized copies it makes on the compute stream per step (packing into a
contiguous buffer and unpacking; none where they run on the all-reduce's own stream), and the
all-reduce's dtype. Every field carries its source.

    >>> p = software_plan("chainermn-1.3-pure_nccl")
    >>> p.overlap, p.bucket_cap_mb, p.copy_passes, p.compression.name
    (False, inf, 2.0, 'none')
    >>> software_plan("chainermn-1.3-pure_nccl-db", compression="fp16").schedule
    'double-buffering'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from commopt.sim.configuration import Configuration

_CHAINERMN_PACK = (
    "ChainerMN 1.3 pure_nccl communicator: packs every gradient into one contiguous GPU "
    "buffer, runs one NCCL all-reduce over all ranks, unpacks (chainermn/communicators, "
    "_memory_utility.pack_params / unpack_params): 2 gradient-sized copies"
)
_NCCL22_RING = (
    "NCCL 2.1/2.2 (ChainerMN's era) has rings only, one flat ring over all ranks (the tree "
    "algorithm arrived in NCCL 2.4)"
)
_CHAINERMN_AFTER = (
    "ChainerMN 1.3 create_multi_node_optimizer: the all-reduce runs after the backward pass, "
    "the update waits for it (no overlap with backward); fp32 unless "
    "allreduce_grad_dtype='float16' (published API)"
)

_CHAINERMN_DB = (
    "double_buffering=True (chainer/chainermn, chainermn/optimizers/double_buffering_optimizer.py, "
    "commit 646001f): the all-reduce of step t runs in a worker thread (ThreadPool(1)) on its own "
    "non-blocking stream during step t+1; the update uses the previous step's averaged gradients"
)
_CHAINERMN_DB_COPIES = (
    "same file: each step swaps the gradient arrays with a deep copy of the model made once "
    "(swap_grad), no gradient-sized copy on the compute stream; the pack, FP16 casts and "
    "unpack run on the all-reduce's own stream, beside compute: 0 copies on the compute stream"
)


@dataclass(frozen=True)
class Software:
    name: str
    description: str
    overlap: bool
    bucket_cap_mb: float
    copy_passes: float
    double_buffering: bool = False
    compression: str = "none"
    algorithm: str = "auto"
    sources: dict = field(default_factory=dict, compare=False)

    def plan(self, **overrides) -> Configuration:
        fields: dict[str, Any] = {
            "overlap": self.overlap,
            "double_buffering": self.double_buffering,
            "bucket_cap_mb": self.bucket_cap_mb,
            "copy_passes": self.copy_passes,
            "compression": self.compression,
            "algorithm": self.algorithm,
        }
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return Configuration(**fields)


SOFTWARE: dict[str, Software] = {
    s.name: s
    for s in (
        Software(
            "chainermn-1.3-pure_nccl",
            "ChainerMN 1.3, pure_nccl communicator, multi-node optimizer (2018)",
            overlap=False,
            bucket_cap_mb=math.inf,
            copy_passes=2,
            algorithm="ring",
            sources={
                "overlap": _CHAINERMN_AFTER,
                "algorithm": _NCCL22_RING,
                "bucket_cap_mb": _CHAINERMN_PACK,
                "copy_passes": _CHAINERMN_PACK,
            },
        ),
        Software(
            "chainermn-1.3-pure_nccl-db",
            "ChainerMN 1.3, pure_nccl, double_buffering=True (2018)",
            overlap=False,
            double_buffering=True,
            bucket_cap_mb=math.inf,
            copy_passes=0,
            algorithm="ring",
            sources={
                "algorithm": _NCCL22_RING,
                "double_buffering": _CHAINERMN_DB,
                "bucket_cap_mb": _CHAINERMN_PACK,
                "copy_passes": _CHAINERMN_DB_COPIES,
            },
        ),
        Software(
            "pytorch-ddp",
            "PyTorch DistributedDataParallel, 25 MB buckets, overlap with backward",
            overlap=True,
            bucket_cap_mb=25.0,
            copy_passes=2,
            algorithm="native",
            sources={
                "algorithm": "NCCL's own choice between ring and tree (NCCL >= 2.4)",
                "bucket_cap_mb": "bucket_cap_mb=25 (PyTorch DDP default)",
                "overlap": "a bucket's all-reduce starts when its gradients are ready (PyTorch DDP)",
                "copy_passes": (
                    "gradient_as_bucket_view=False (default): gradients are copied into "
                    "the bucket and back: 2 gradient-sized copies"
                ),
            },
        ),
        Software(
            "commopt",
            "commopt's communicator: 25 MB buckets, overlap with backward",
            overlap=True,
            bucket_cap_mb=25.0,
            copy_passes=1,
            sources={
                "copy_passes": (
                    "commopt copies the gradients into its buckets; the decode writes the "
                    "averaged result into .grad: 1 gradient-sized copy"
                )
            },
        ),
    )
}


def list_software() -> list[str]:
    return sorted(SOFTWARE)


def software_plan(name: str, **overrides) -> Configuration:
    """The plan of software ``name``; keyword arguments (not None) override its fields."""
    if name not in SOFTWARE:
        raise ValueError(f"unknown software {name!r}; choose one of {', '.join(list_software())}")
    return SOFTWARE[name].plan(**overrides)
