"""Error-feedback residuals across world sizes (commopt.collectives.residuals): where each key
lies, and that resharding keeps every element's sum over the ranks."""

import itertools
import logging

import pytest
import torch

import commopt
from commopt.codecs import CompressionPolicy
from commopt.collectives.residuals import (
    SAVED_BY_RANKS,
    NotReshardable,
    residual_spans,
    share,
    summed_residuals,
)
from commopt.optim import create_multi_node_optimizer

SMALL_PIECES = 64  # bytes per piece: several pieces per buffer


def spans_of_every_rank(size, numel, alignment, algorithm="scatter_reduce"):
    return [
        residual_spans(
            algorithm,
            rank=r,
            size=size,
            numel=numel,
            alignment=alignment,
            key="b0:x",
            piece_bytes=SMALL_PIECES,
        )
        for r in range(size)
    ]


@pytest.mark.parametrize("size, numel, alignment", [(2, 10, 4), (3, 100, 8), (4, 37, 1)])
def test_every_chunk_has_one_owner_and_its_senders_agree_on_where_it_lies(size, numel, alignment):
    spans = spans_of_every_rank(size, numel, alignment)
    owned = sorted(span for r in range(size) for k, span in spans[r].items() if "/ag" in k)
    # The owners' chunks tile the buffer, in order, each starting on the alignment.
    assert owned[0][0] == 0 and owned[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(owned)), owned
    assert all(lo % alignment == 0 for lo, _ in owned), owned
    # Chunk i = k * size + j (piece k, owner j): every other rank sends it under rs{i}.
    for r in range(size):
        for key, (lo, hi) in spans[r].items():
            tail = key.rsplit("/", 1)[1]
            if tail.startswith("rs"):
                i = int(tail[2:])
                k, j = divmod(i, size)
                assert j != r and spans[j][f"b0:x/ag{k}"] == (lo, hi), (r, key, spans[j])


def dense(residuals, spans, numel):
    out = torch.zeros(numel)
    for key, value in residuals.items():
        lo, hi = spans[key]
        out[lo:hi] += value
    return out


@pytest.mark.parametrize("old, new", [(2, 3), (4, 2), (3, 1 + 4), (2, 2)])
@pytest.mark.parametrize("new_algorithm", ["scatter_reduce", "native"])
def test_resharding_keeps_each_elements_sum_over_the_ranks(old, new, new_algorithm):
    numel, alignment = 45, 4
    g = torch.Generator().manual_seed(old * 10 + new)
    old_spans = spans_of_every_rank(old, numel, alignment)
    saved = [{k: torch.randn(hi - lo, generator=g) for k, (lo, hi) in s.items()} for s in old_spans]
    want = sum(dense(saved[r], old_spans[r], numel) for r in range(old))
    total = summed_residuals(
        saved, "b0:x", numel=numel, alignment=alignment, piece_bytes=SMALL_PIECES
    )
    assert torch.allclose(total, want, atol=1e-6)
    new_spans = spans_of_every_rank(new, numel, alignment, new_algorithm)
    shares = [
        share(
            total,
            new_algorithm,
            rank=r,
            size=new,
            key="b0:x",
            alignment=alignment,
            piece_bytes=SMALL_PIECES,
        )
        for r in range(new)
    ]
    got = sum(dense(shares[r], new_spans[r], numel) for r in range(new))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    if new_algorithm == "scatter_reduce":  # each chunk's sum, exactly, on its owner
        assert all(k.rsplit("/", 1)[1].startswith("ag") for s in shares for k in s)


def test_a_native_buffers_residual_is_the_whole_buffer():
    saved = [{"b1:6": torch.ones(6)}, {"b1:6": 2 * torch.ones(6)}, {}]
    assert summed_residuals(saved, "b1:6", numel=6, alignment=1).tolist() == [3.0] * 6
    assert summed_residuals([{}, {}], "b1:6", numel=6, alignment=1) is None


@pytest.mark.parametrize(
    "saved, why",
    [
        ([{"b0:8/x": torch.ones(4)}, {"b0:8/x": torch.ones(4)}], "node layout"),
        ([{"b0:8/ag0": torch.ones(3)}, {}], "is not where 2 ranks cut a buffer of 8 elements"),
        ([{"b0:8/zz": torch.ones(3)}, {}], "of no plan this commopt knows"),
    ],
)
def test_residuals_that_cannot_be_placed_say_why(saved, why):
    with pytest.raises(NotReshardable, match=why):
        summed_residuals(saved, "b0:8", numel=8, alignment=1)


def test_a_world_of_one_drops_the_residuals_and_logs_which(caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        commopt.create_communicator("local"),
        model=model,
        compression="qsgd4+ef",
        policy=CompressionPolicy(min_compress_numel=16),
    )
    sd = opt.state_dict()
    (part,) = sd["commopt"]["plans"]  # one plan: the optimizer's one part
    key = max(sd["commopt"]["plans"][part]["buckets"], key=lambda k: int(k.split(":")[1]))
    # Rank 0 of 2: its own chunk and the one it sends (QSGD's 128-element alignment).
    saved = [{"residuals": {f"{key}/ag0": torch.ones(128), f"{key}/rs1": torch.ones(128)}}, {}]
    sd["commopt"]["codec_state"] = {part: {"compressed": {SAVED_BY_RANKS: saved}}}
    with caplog.at_level(logging.WARNING, logger="commopt"):
        opt.load_state_dict(sd)
    assert not opt.state_dict()["commopt"]["codec_state"][part]["compressed"]["residuals"]
    assert f"dropped for bucket(s) {key}" in caplog.text, caplog.text
    assert "a world of one sends nothing through the codec" in caplog.text, caplog.text
