"""``get_codec``: codecs by name.

>>> get_codec("qsgd4+ef")
ErrorFeedback(QSGD(bits=4, bucket_size=128, scale='max'))
>>> get_codec("fp16").name
'fp16'
>>> get_codec("powersgd4")
PowerSGD(rank=4)
>>> get_codec("powersgd4-start100")  # warm-up: reductions 0..99 uncompressed
PowerSGD(rank=4, start_iter=100)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from commopt.codecs.base import Codec
from commopt.codecs.cast import CastCodec, NoneCodec
from commopt.codecs.error_feedback import ErrorFeedback
from commopt.codecs.lowrank import PowerSGD
from commopt.codecs.qsgd import QSGD

_FACTORIES: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "fp32": NoneCodec,
    "fp16": lambda: CastCodec(torch.float16),
    "bf16": lambda: CastCodec(torch.bfloat16),
    "qsgd2": lambda: QSGD(bits=2, bucket_size=128),
    "qsgd4": lambda: QSGD(bits=4, bucket_size=128),
    "qsgd8": lambda: QSGD(bits=8, bucket_size=128),
}
#: Low-rank ranks registered by name ("powersgd4": rank 4, its own error feedback).
LOW_RANKS = (1, 2, 4, 8, 16, 32)


def _low_rank(rank: int) -> Callable[[], Codec]:
    return lambda: PowerSGD(rank=rank)


_FACTORIES.update({f"powersgd{r}": _low_rank(r) for r in LOW_RANKS})
EF_SUFFIX = "+ef"
#: ``"powersgd4-start1000"``: a low-rank name with a warm-up of 1000 uncompressed reductions.
START_SUFFIX = "-start"


def codec_names() -> list[str]:
    """Every name ``get_codec`` accepts (each also with the ``+ef`` suffix, except the
    low-rank ``powersgdN``, whose error feedback is built in; those take ``-startK`` instead,
    a warm-up of K uncompressed reductions)."""
    return list(_FACTORIES)


def get_codec(spec: str | Codec | None) -> Codec:
    """A codec from a name (``"none"``, ``"fp16"``, ``"qsgd4+ef"``...) or a Codec (returned as is)."""
    if spec is None:
        return NoneCodec()
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"codec spec must be a name or a Codec, got {type(spec).__name__}")
    name = spec.strip().lower()
    ef = name.endswith(EF_SUFFIX)
    if ef:
        name = name[: -len(EF_SUFFIX)]
    start_iter = 0
    base, sep, start = name.partition(START_SUFFIX)
    if sep and base.startswith("powersgd") and base in _FACTORIES:
        if not start.isdigit():
            raise ValueError(
                f"codec {spec!r}: the warm-up suffix takes a number of reductions, e.g. "
                f"'{base}{START_SUFFIX}1000'"
            )
        name, start_iter = base, int(start)
    factory = _FACTORIES.get(name)
    if name == "auto":
        raise ValueError(
            "'auto' is not a codec: create_multi_node_optimizer(compression='auto') chooses a "
            "codec per tensor; here, name one codec (e.g. 'qsgd4', 'powersgd4')"
        )
    if factory is None:
        valid = ", ".join(codec_names())
        raise ValueError(
            f"unknown codec {spec!r}; valid names: {valid} (append '+ef' for error feedback), "
            "or pass a Codec instance such as commopt.codecs.QSGD(bits=4, bucket_size=128)"
        )
    if start_iter:
        codec: Codec = PowerSGD(rank=int(name[len("powersgd") :]), start_iter=start_iter)
    else:
        codec = factory()
    if ef and isinstance(codec, PowerSGD):
        raise ValueError(
            f"{name!r} keeps its own error feedback: use {name!r} without '+ef' "
            f"(PowerSGD(rank={codec.rank}, error_feedback=False) turns it off)"
        )
    return ErrorFeedback(codec) if ef else codec
