"""Resuming a 2-rank checkpoint with 1 rank: the replicated part always, residuals as asked.

Error-feedback residuals are each rank's own, per chunk of its reduce-scatter:
``residuals="refuse"`` (the default) raises naming both counts and why, ``"drop"`` restarts
them at zero and restores the rest exactly. State saved between steps of compensated double
buffering (each rank's predicted weights) is refused at another count.
"""

import pytest
import torch

import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer, load_checkpoint
from tests.multirank import run_torch

pytestmark = pytest.mark.distributed

BUILD = r"""
import torch
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer


def build(comm, double_buffering=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm, model=model,
        compression="qsgd4+ef", double_buffering=double_buffering,
        policy=CompressionPolicy(min_compress_numel=64))
    return model, opt
"""

RANK_SCRIPT = (
    BUILD
    + r"""
import sys
import commopt
from commopt.optim import save_checkpoint

comm = commopt.create_communicator("torch")
for name, db in (("ef", False), ("compensated", "compensated")):
    model, opt = build(comm, db)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + comm.rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(8, 64, generator=g)), torch.randn(8, 4, generator=g)).backward()
        opt.step()
    save_checkpoint(f"{sys.argv[1]}/{name}", model, opt)
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


def residuals(opt):
    return next(iter(opt.state_dict()["commopt"]["codec_state"].values()))["compressed"][
        "residuals"
    ]


def test_resume_at_another_world_size(tmp_path):
    out = run_torch(RANK_SCRIPT, 2, args=[str(tmp_path)], timeout=240)
    assert [o.strip() for o in out] == ["saved 0", "saved 1"]
    saved_model = torch.load(tmp_path / "model.pt")
    model, opt = build()
    with pytest.raises(
        ValueError,
        match="of 2 ranks but this job has 1: each rank's residuals belong to the chunks",
    ):
        load_checkpoint(tmp_path / "ef", model, opt)

    model, opt = build()
    load_checkpoint(tmp_path / "ef", model, opt, residuals="drop")
    assert opt.applied_steps == 3 and not residuals(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved_model))

    model, opt = build("compensated")
    with pytest.raises(ValueError, match=r"compensated double buffering.*Resume with 2 ranks"):
        load_checkpoint(tmp_path / "compensated", model, opt, residuals="drop")
