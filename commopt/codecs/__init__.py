"""Gradient codecs: how a flat float32 chunk is written on the wire and read back.

    >>> import torch
    >>> from commopt.codecs import get_codec
    >>> codec = get_codec("qsgd4")
    >>> codec.encoded_nbytes(1 << 20) / (4 << 20) < 0.14
    True

See docs/codecs.md for each codec's wire format, error bound and when to pick it.
"""

from commopt.codecs.base import Codec, RngKey
from commopt.codecs.cast import CastCodec, NoneCodec
from commopt.codecs.error_feedback import ErrorFeedback
from commopt.codecs.lowrank import PowerSGD
from commopt.codecs.policy import CompressionPolicy
from commopt.codecs.qsgd import QSGD
from commopt.codecs.registry import codec_names, get_codec

__all__ = [
    "QSGD",
    "CastCodec",
    "Codec",
    "CompressionPolicy",
    "ErrorFeedback",
    "NoneCodec",
    "PowerSGD",
    "RngKey",
    "codec_names",
    "get_codec",
]
