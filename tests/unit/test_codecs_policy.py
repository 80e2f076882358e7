"""The per-layer policy, bucket alignment, and get_codec."""

from __future__ import annotations

import pytest
import torch

from commopt.codecs import QSGD, CompressionPolicy, ErrorFeedback, codec_names, get_codec


def test_default_policy_follows_the_published_rule():
    p = CompressionPolicy()
    assert p.min_compress_numel == 1024 and not p.compress_1d
    assert p.should_compress("conv1.weight", (64, 3, 7, 7))  # 9408 elements, 4-D
    assert not p.should_compress("fc.bias", (1000,))  # dim <= 1
    assert not p.should_compress("small.weight", (16, 63))  # 1008 < 1024
    assert p.should_compress("small.weight", (16, 64))  # exactly 1024
    assert not p.should_compress("layer1.0.bn1.weight", (64, 64))  # excluded by name
    assert not p.should_compress("encoder.layer_norm.weight", (1024, 2))
    assert p.should_compress("attn.in_proj_weight", (3072, 1024))


def test_policy_is_configurable_and_validates():
    p = CompressionPolicy(min_compress_numel=0, exclude=(r"^embed",), compress_1d=True)
    assert p.should_compress("fc.bias", (10,)) and not p.should_compress("embed.weight", (100, 8))
    assert p.should_compress("", ())  # a scalar with compress_1d and no minimum
    with pytest.raises(ValueError, match="regex"):
        CompressionPolicy(exclude=("(",))
    with pytest.raises(TypeError, match="sequence"):
        CompressionPolicy(exclude="bias")
    with pytest.raises(ValueError, match=">= 0"):
        CompressionPolicy(min_compress_numel=-1)
    with pytest.raises(ValueError, match="uncompressed"):
        CompressionPolicy(uncompressed="int8")


def test_the_bucket_layout_keeps_quantisation_groups_inside_one_tensor():
    """The reducer's layout starts every compressed tensor at a multiple of the codec's
    alignment, so no QSGD group of 128 holds elements of two tensors."""
    from commopt.reducer.layout import build_buckets

    numels = [300 * 16, 5 * 1024, 128 * 8, 1024, 129 * 8]
    params = [torch.zeros(n // 8, 8) if n % 8 == 0 else torch.zeros(n) for n in numels]
    codec = QSGD()
    (bucket,) = build_buckets(
        params,
        [f"l{i}.weight" for i in range(len(params))],
        codec=codec,
        plain_codec=None,
        policy=CompressionPolicy(min_compress_numel=0),
    )
    assert bucket.codec is codec and bucket.numel % 128 == 0
    owner = torch.full((bucket.numel,), -1)
    for s in bucket.slots:
        assert s.offset % codec.alignment == 0
        owner[s.offset : s.offset + s.numel] = s.param
    for group in owner.view(-1, 128):
        assert len(set(group[group >= 0].tolist())) <= 1


def test_get_codec_names():
    assert set(codec_names()) >= {"none", "fp32", "fp16", "bf16", "qsgd2", "qsgd4", "qsgd8"}
    q = get_codec("qsgd8")
    assert (q.bits, q.bucket_size, q.norm, q.stochastic, q.levels) == (8, 128, "max", True, 127)
    ef = get_codec("QSGD4+EF")
    assert isinstance(ef, ErrorFeedback) and ef.inner.bits == 4
    assert get_codec(q) is q and get_codec(None).name == "none"
    with pytest.raises(
        ValueError, match="valid names: none, fp32, fp16, bf16, qsgd2, qsgd4, qsgd8"
    ):
        get_codec("qsgd3")
    with pytest.raises(TypeError):
        get_codec(4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"bits": 3}, "bits"),
        ({"levels": 8}, "levels"),
        ({"bucket_size": 0}, "bucket_size"),
        ({"scale": "l1"}, "scale"),
        ({"scale_dtype": torch.bfloat16}, "scale_dtype"),
    ],
)
def test_qsgd_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QSGD(**kwargs)


def test_every_parameter_lands_in_a_bucket_when_kinds_mix():
    # Compressed and plain tensors open buckets of different kinds; closing the open ones at
    # the end must close all of them (a loop that removed from the list it walked skipped
    # every other kind and silently dropped their parameters from the reduction).
    from commopt.reducer.layout import build_buckets

    params = [torch.zeros(64, 64), torch.zeros(64), torch.zeros(16, 64), torch.zeros(16)]
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    buckets = build_buckets(
        params,
        names,
        codec=get_codec("qsgd4"),
        plain_codec=get_codec("fp16"),
        policy=CompressionPolicy(min_compress_numel=64),
    )
    placed = sorted(s.param for b in buckets for s in b.slots)
    assert placed == [0, 1, 2, 3], f"parameters in buckets: {placed}"
    assert {b.compressed for b in buckets} == {True, False}
