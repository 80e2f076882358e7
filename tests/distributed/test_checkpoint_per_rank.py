"""Error-feedback checkpoints hold each rank's own residuals only, on 2 real ranks.

``state_dict()`` communicates nothing (rank 0 alone may call it), its residuals are this
rank's (as many elements as the compressed parameters, not N times), a rank refuses
another rank's state, and ``save_checkpoint`` writes per-rank parts whose size does not
depend on the number of ranks. Resuming with another number of ranks raises an error
naming both counts, or restarts the residuals at zero when asked.
"""

import pytest
import torch

import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer, load_checkpoint
from tests.multirank import run_mpi, run_torch

pytestmark = pytest.mark.distributed

RANK_SCRIPT = r"""
import sys
import torch
import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer

comm = commopt.create_communicator("mpi")
r, n = comm.rank, comm.size
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), comm, model=model,
                                  compression="qsgd4+ef", policy=CompressionPolicy(min_compress_numel=64))
for step in range(2):
    g = torch.Generator().manual_seed(100 * step + r)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(torch.randn(8, 64, generator=g)), torch.randn(8, 4, generator=g)).backward()
    opt.step()
opt.wait()
if r == 0:  # rank 0 alone: no collective may be waiting for rank 1
    sd = opt.state_dict()
    residuals = next(iter(sd["commopt"]["codec_state"].values()))["compressed"]["residuals"]
    compressed = sum(p.numel() for p in model.parameters() if p.numel() >= 64)
    held = sum(t.numel() for t in residuals.values())
    assert 0 < held <= compressed, f"rank 0 holds {held} residual elements for {compressed} compressed ones"
    torch.save(sd, sys.argv[1] + "/rank0.pt")
comm.barrier()
if r == 1:
    other = torch.load(sys.argv[1] + "/rank0.pt", weights_only=False)
    try:
        opt.load_state_dict(other)
    except ValueError as e:
        assert "rank 0's codec state" in str(e), e
    else:
        raise AssertionError("rank 1 loaded rank 0's residuals")
from commopt.optim import save_checkpoint
from commopt.optim.checkpoint_files import checkpoint_bytes

save_checkpoint(sys.argv[1] + "/ckpt", model, opt)
sizes = checkpoint_bytes(sys.argv[1] + "/ckpt")
assert sorted(sizes) == ["rank0", "rank1", "replicated"], sizes
print("per-rank ok", r)
"""


def mlp_opt(comm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        comm,
        model=model,
        compression="qsgd4+ef",
        policy=CompressionPolicy(min_compress_numel=64),
    )
    return model, opt


def test_each_rank_saves_and_loads_only_its_own_residuals(tmp_path):
    out = run_mpi(
        RANK_SCRIPT,
        2,
        args=[str(tmp_path)],
        timeout=180,
        # read only by versions that gathered residuals: fail fast there, not hang
        env={"COMMOPT_STATE_DICT_TIMEOUT": "5"},
    )
    assert [o.strip() for o in out] == ["per-rank ok 0", "per-rank ok 1"]
    # Resume the 2-rank checkpoint on 1 rank (this process): refused when asked, naming both
    # counts...
    model, opt = mlp_opt(commopt.create_communicator("local"))
    with pytest.raises(ValueError, match="of 2 ranks but this job has 1"):
        load_checkpoint(tmp_path / "ckpt", model, opt, residuals="refuse")
    # ... or, when asked, everything but the residuals, which restart at zero.
    load_checkpoint(tmp_path / "ckpt", model, opt, reset_codec_state=True)
    assert opt.applied_steps == 2
    assert not next(iter(opt.state_dict()["commopt"]["codec_state"].values()))["compressed"][
        "residuals"
    ]


TORCH_SCRIPT = r"""
import sys
import torch
import torch.distributed as dist
import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer, load_checkpoint, save_checkpoint

comm = commopt.create_communicator("torch")  # a torch process group exists: DCP must not use it
assert dist.is_initialized()
r = comm.rank


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), comm, model=model,
                                      compression="qsgd4+ef", policy=CompressionPolicy(min_compress_numel=64))
    return model, opt


def train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + r)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(8, 64, generator=g)), torch.randn(8, 4, generator=g)).backward()
        opt.step()


model, opt = build(0)
train(model, opt, range(2))
save_checkpoint(sys.argv[1], model, opt)
train(model, opt, range(2, 4))
model2, opt2 = build(7)
load_checkpoint(sys.argv[1], model2, opt2)
train(model2, opt2, range(2, 4))
for i, (p, q) in enumerate(zip(model.parameters(), model2.parameters())):
    assert torch.equal(p, q), f"parameter {i} differs after resuming"
print("torch ok", r)
"""


def test_save_load_checkpoint_with_a_torch_process_group(tmp_path):
    out = run_torch(TORCH_SCRIPT, 2, args=[str(tmp_path / "ckpt")], timeout=180)
    assert [o.strip() for o in out] == ["torch ok 0", "torch ok 1"]
