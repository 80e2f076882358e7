"""Checkpoints: 2N steps == N steps, save, restore in new processes, N steps.

Bit-identical for the fp32 path, for double buffering (the pending averaged gradients are
in the checkpoint), for QSGD with error feedback (each rank's residuals and the RNG
seed/step restore exactly) and for the low-rank codec (its warm-start Q and residuals). Two ways to save: each rank ``torch.save``s its own
``opt.state_dict()`` (the model on rank 0), and ``commopt.optim.save_checkpoint`` (DCP).
"""

import pytest

from tests.multirank import run_mpi

pytestmark = pytest.mark.distributed

RANK_SCRIPT = r"""
import sys
import torch
import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer, load_checkpoint, save_checkpoint

backend, phase, workdir = sys.argv[1], sys.argv[2], sys.argv[3]
comm = commopt.create_communicator(backend)
r, n = comm.rank, comm.size
N = 3
CONFIGS = {
    "sgd-fp32": dict(opt="sgd"),
    "adam-fp32-double-buffering": dict(opt="adam", double_buffering="stale"),
    "sgd-qsgd4-ef": dict(opt="sgd", compression="qsgd4+ef"),
    "adam-qsgd4-ef-double-buffering": dict(opt="adam", compression="qsgd4+ef", double_buffering="stale"),
    "sgd-powersgd2-double-buffering": dict(opt="sgd", compression="powersgd2", double_buffering="stale"),
}


def build(cfg, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 4))
    inner = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if cfg["opt"] == "sgd"
             else torch.optim.Adam(model.parameters(), lr=0.01))
    opt = create_multi_node_optimizer(
        inner, comm, double_buffering=cfg.get("double_buffering", False),
        compression=cfg.get("compression"), model=model, bucket_cap_mb=0.002,
        policy=CompressionPolicy(min_compress_numel=64))
    return model, opt


def train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + r)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


for name, cfg in CONFIGS.items():
    path = f"{workdir}/{name}"
    if phase == "first":
        model, opt = build(cfg, seed=0)
        train(model, opt, range(N))
        state = opt.state_dict()  # this rank's own residuals only: each rank saves its own
        torch.save({"model": model.state_dict(), "opt": state}, path + f".rank{r}.ckpt")
        save_checkpoint(path + ".dcp", model, opt, extra={"step": N})
        train(model, opt, range(N, 2 * N))
        if r == 0:
            torch.save([p.detach().clone() for p in model.parameters()], path + ".final")
        assert state["commopt"]["rank"] == r and state["commopt"]["world_size"] == n
        if cfg.get("compression"):
            assert next(iter(state["commopt"]["codec_state"].values()))["compressed"]["residuals"]
    else:
        comm.barrier()
        final = torch.load(path + ".final")
        for how in ("torch.save", "save_checkpoint"):
            model, opt = build(cfg, seed=123)  # other weights: the checkpoint must win
            if how == "torch.save":
                ckpt = torch.load(path + f".rank{r}.ckpt", weights_only=False)
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
            else:
                assert load_checkpoint(path + ".dcp", model, opt) == {"step": N}
            train(model, opt, range(N, 2 * N))
            for i, (p, q) in enumerate(zip(model.parameters(), final)):
                assert torch.equal(p.detach(), q), f"{name} ({how}): parameter {i} differs after resuming: {(p - q).abs().max()}"
print(f"checkpoint {phase} ok rank {r}")
"""


YIELD = ["--mca", "mpi_yield_when_idle", "1"]  # ranks share the cores with other jobs


def test_checkpoint_resume_in_new_processes_is_bit_identical(tmp_path):
    out = run_mpi(
        RANK_SCRIPT, 2, args=["mpi", "first", str(tmp_path)], timeout=240, mpirun_args=YIELD
    )
    assert [o.strip() for o in out] == ["checkpoint first ok rank 0", "checkpoint first ok rank 1"]
    out = run_mpi(
        RANK_SCRIPT, 2, args=["mpi", "resume", str(tmp_path)], timeout=240, mpirun_args=YIELD
    )
    assert [o.strip() for o in out] == [
        "checkpoint resume ok rank 0",
        "checkpoint resume ok rank 1",
    ]
