"""Resuming a 2-rank checkpoint with 1 and 3 ranks: the replicated part always, residuals as
asked.

Error-feedback residuals are each rank's own, per chunk of its reduce-scatter:
``residuals="reshard"`` (the default) sums them over the saved ranks and hands each new rank its
share, keeping every element's sum (3 ranks, scatter-reduce and native plans; a world of one
sends nothing through the codec, so there they are dropped and rank 0 logs it),
``"refuse"`` raises naming both counts and why, ``"drop"`` restarts them at zero and restores
the rest exactly. State saved between steps of compensated double buffering (each rank's
predicted weights) is refused at another count.
"""

import logging

import pytest
import torch

import commopt
from commopt.codecs import CompressionPolicy, get_codec
from commopt.collectives.residuals import summed_residuals
from commopt.optim import create_multi_node_optimizer, load_checkpoint
from tests.multirank import run_torch

pytestmark = pytest.mark.distributed

BUILD = r"""
import torch
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer


def build(comm, double_buffering=False, compression="qsgd4+ef"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm, model=model,
        compression=compression, double_buffering=double_buffering,
        policy=CompressionPolicy(min_compress_numel=64))
    return model, opt


def train(model, opt, comm, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + comm.rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(8, 64, generator=g)), torch.randn(8, 4, generator=g)).backward()
        opt.step()


def residuals(opt):
    return next(iter(opt.state_dict()["commopt"]["codec_state"].values()))["compressed"]["residuals"]
"""

RANK_SCRIPT = (
    BUILD
    + r"""
import sys
import commopt
from commopt.optim import save_checkpoint

comm = commopt.create_communicator("torch")
for name, db, compression in (
    ("ef", False, "qsgd4+ef"),                # scatter-reduce plan
    ("compensated", "compensated", "qsgd4+ef"),
    ("fp16ef", False, "fp16+ef"),             # native plan
):
    model, opt = build(comm, db, compression)
    train(model, opt, comm, 3)
    save_checkpoint(f"{sys.argv[1]}/{name}", model, opt)
    if db is False:
        torch.save(residuals(opt), f"{sys.argv[1]}/{name}-saved{comm.rank}.pt")
    if name == "ef" and comm.rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], f"{sys.argv[1]}/model.pt")
print("saved", comm.rank)
"""
)


def build(double_buffering=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        commopt.create_communicator("local"),
        model=model,
        compression="qsgd4+ef",
        double_buffering=double_buffering,
        policy=CompressionPolicy(min_compress_numel=64),
    )
    return model, opt


RESUME_SCRIPT = (
    BUILD
    + r"""
import sys
import commopt
from commopt.optim import load_checkpoint

comm = commopt.create_communicator("torch")
for name, compression in (("ef", "qsgd4+ef"), ("fp16ef", "fp16+ef")):
    model, opt = build(comm, False, compression)
    load_checkpoint(f"{sys.argv[1]}/{name}", model, opt)  # residuals="reshard"
    torch.save(residuals(opt), f"{sys.argv[1]}/{name}-loaded{comm.rank}.pt")
    train(model, opt, comm, 2)  # the plan encodes with every share it was given
    assert all(torch.isfinite(p).all() for p in model.parameters())
print("resumed", comm.rank)
"""
)


def residuals(opt):
    return next(iter(opt.state_dict()["commopt"]["codec_state"].values()))["compressed"][
        "residuals"
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of each kind saved by 2 ranks, and each rank's residuals."""
    path = tmp_path_factory.mktemp("reshard")
    out = run_torch(RANK_SCRIPT, 2, args=[str(path)], timeout=240)
    assert [o.strip() for o in out] == ["saved 0", "saved 1"]
    return path


@pytest.fixture(scope="module")
def resumed(saved):
    """The 2-rank checkpoints resumed by 3 ranks (residuals resharded), each rank's residuals."""
    out = run_torch(RESUME_SCRIPT, 3, args=[str(saved)], timeout=240)
    assert [o.strip() for o in out] == [f"resumed {r}" for r in range(3)]
    return saved


@pytest.mark.parametrize("name, compression", [("ef", "qsgd4+ef"), ("fp16ef", "fp16+ef")])
def test_residuals_follow_the_world_size(resumed, name, compression):
    saved = resumed
    alignment = get_codec(compression).alignment
    before = [torch.load(saved / f"{name}-saved{r}.pt") for r in range(2)]
    after = [torch.load(saved / f"{name}-loaded{r}.pt") for r in range(3)]
    keys = {k.split("/")[0] for r in before for k in r}
    assert keys, "the 2-rank run kept no residuals"
    for key in sorted(keys):
        numel = int(key.split(":")[1])
        # Summing places each key by where the plan cuts the bucket: the 2 saved ranks' keys
        # (written by the real plan) and the 3 new ranks' shares must both fit.
        want = summed_residuals(before, key, numel=numel, alignment=alignment)
        got = summed_residuals(after, key, numel=numel, alignment=alignment)
        assert want is not None and got is not None and want.abs().sum() > 0, key
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"bucket {key}")


def test_resume_at_another_world_size(saved, caplog):
    tmp_path = saved
    saved_model = torch.load(tmp_path / "model.pt")
    model, opt = build()
    with pytest.raises(
        ValueError,
        match="of 2 ranks but this job has 1: each rank's residuals belong to the chunks",
    ):
        load_checkpoint(tmp_path / "ef", model, opt, residuals="refuse")

    model, opt = build()
    with caplog.at_level(logging.WARNING, logger="commopt"):
        load_checkpoint(tmp_path / "ef", model, opt)  # reshard: a world of one has no use
    assert opt.applied_steps == 3 and not residuals(opt)
    assert "a world of one sends nothing through the codec" in caplog.text, caplog.text

    model, opt = build()
    load_checkpoint(tmp_path / "ef", model, opt, residuals="drop")
    assert opt.applied_steps == 3 and not residuals(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved_model))

    model, opt = build("compensated")
    with pytest.raises(ValueError, match=r"compensated double buffering.*Resume with 2 ranks"):
        load_checkpoint(tmp_path / "compensated", model, opt, residuals="drop")
