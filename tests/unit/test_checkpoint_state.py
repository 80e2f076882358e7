"""The per-rank checkpoint format: checks, version 1 compatibility, DCP save/load helpers."""

import pytest
import torch

import commopt
from commopt.checkpointing import CheckpointError
from commopt.codecs import CompressionPolicy
from commopt.optim import (
    create_multi_node_optimizer,
    drop_codec_state,
    load_checkpoint,
    save_checkpoint,
)
from commopt.optim.checkpoint import check_compatible, own_codec_state, split_rank_state

RES = {"compressed": {"residuals": {"b0": torch.ones(3)}}}


def extra(**kw):
    return {"version": 2, "rank": 0, "world_size": 1, "buckets": ["b0"], "codec_state": RES, **kw}


def test_check_compatible_names_what_differs():
    check_compatible(extra(), ["b0"], rank=0, size=1)
    with pytest.raises(ValueError, match=r"rank 1 of 4 ranks but this job has 1.*drop_codec_state"):
        check_compatible(extra(rank=1, world_size=4), ["b0"], rank=0, size=1)
    with pytest.raises(ValueError, match="rank 1: this state dict holds rank 0's codec state"):
        check_compatible(extra(world_size=2), ["b0"], rank=1, size=2)
    with pytest.raises(ValueError, match="version 9"):
        check_compatible(extra(version=9), ["b0"], rank=0, size=1)
    # without residuals any rank may load any rank's state, with any number of ranks
    check_compatible(extra(codec_state={"plain": {}}, world_size=8, rank=3), ["b0"], rank=0, size=2)


def test_version_1_every_rank_states_still_load():
    old = {"version": 1, "buckets": ["b0"], "codec_states": [{"c": 0}, RES]}
    check_compatible(old, ["b0"], rank=1, size=2)
    assert own_codec_state(old, 1) is RES
    with pytest.raises(ValueError, match="of 2 ranks but this job has 3"):
        check_compatible(old, ["b0"], rank=0, size=3)


def test_drop_codec_state_restarts_residuals_only():
    sd = {"state": {}, "commopt": extra(world_size=4, rank=2)}
    dropped = drop_codec_state(sd)
    assert dropped["commopt"]["codec_state"] == {} and sd["commopt"]["codec_state"] is RES
    check_compatible(dropped["commopt"], ["b0"], rank=0, size=1)
    replicated, own = split_rank_state(sd)
    assert "codec_state" not in replicated["commopt"] and own["codec_state"] is RES


def build(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = create_multi_node_optimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        commopt.create_communicator("local"),
        model=model,
        compression="qsgd4+ef",
        policy=CompressionPolicy(min_compress_numel=16),
    )
    return model, opt


def train(model, opt, steps):
    for s in steps:
        g = torch.Generator().manual_seed(s)
        opt.zero_grad()
        model(torch.randn(4, 32, generator=g)).square().mean().backward()
        opt.step()


def test_save_load_checkpoint_resumes_bit_exactly(tmp_path):
    model, opt = build()
    train(model, opt, range(2))
    save_checkpoint(tmp_path / "c", model, opt, extra={"epoch": 1})
    train(model, opt, range(2, 4))
    model2, opt2 = build(seed=5)
    assert load_checkpoint(tmp_path / "c", model2, opt2) == {"epoch": 1}
    train(model2, opt2, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_load_checkpoint_errors_say_what_to_do(tmp_path):
    model, opt = build()
    with pytest.raises(FileNotFoundError, match="not a commopt checkpoint"):
        load_checkpoint(tmp_path, model, opt)
    train(model, opt, range(1))
    save_checkpoint(tmp_path / "c", model, opt)
    # A part moved away is damage the manifest names, never a resume without that state.
    (tmp_path / "c" / "rank0").rename(tmp_path / "c" / "rank5")
    with pytest.raises(CheckpointError, match=r"rank0/.*is missing.*load an earlier one"):
        load_checkpoint(tmp_path / "c", model, opt)
    with pytest.raises(CheckpointError, match=r"is missing"):
        load_checkpoint(tmp_path / "c", model, opt, reset_codec_state=True)
