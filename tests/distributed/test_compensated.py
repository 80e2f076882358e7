"""``double_buffering="compensated"`` on 2 real ranks (mpirun and torch.distributed gloo).

One script per transport checks: the ranks' true weights and optimizer state stay
bit-identical while their predicted weights differ (each predicts from its own gradient),
with qsgd4+ef; training on a learnable task converges; a run resumed from a mid-run
``save_checkpoint`` ends bit for bit where the uninterrupted run ends; ranks that disagree
on the mode raise ``SettingsMismatchError``. Every failure names its rank.
"""

import pytest

from tests.multirank import run_mpi, run_torch

pytestmark = pytest.mark.distributed

SCRIPT = r"""
import hashlib, sys
import torch
import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer, load_checkpoint, save_checkpoint
from commopt.optim.fingerprint import SettingsMismatchError

backend, path = sys.argv[1], sys.argv[2]
comm = commopt.create_communicator(backend)
r = comm.rank
TEACHER = torch.Generator().manual_seed(9)
W = torch.randn(16, 4, generator=TEACHER)


def build(seed, mode="compensated"):
    torch.manual_seed(seed + 10 * r)   # differs per rank: the wrapper broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = create_multi_node_optimizer(
        torch.optim.AdamW(model.parameters(), lr=0.02), comm, model=model, double_buffering=mode,
        compression="qsgd4+ef", policy=CompressionPolicy(min_compress_numel=64), clip_grad_norm=5.0)
    return model, opt


def loss_of(model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 16, generator=g)
    return torch.nn.functional.mse_loss(model(x), x @ W)


def train(model, opt, steps):
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)   # both gradient layouts (copies, bucket views)
        loss_of(model, step, r).backward()
        opt.step()


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {r}: {what}")


model, opt = build(0)
with torch.no_grad():
    start = sum(loss_of(model, 10_000 + i, 0).item() for i in range(4))
train(model, opt, range(5))
predicted = comm.allgather_obj(digest(model.parameters()))
check(predicted[0] != predicted[1], "the ranks' predicted weights are equal: no local prediction")
with opt.true_weights():
    true = comm.allgather_obj(digest(model.parameters()))
check(true[0] == true[1], "true weights differ between ranks")
state = comm.allgather_obj(digest([t for s in opt.inner.state.values() for t in s.values()
                                   if isinstance(t, torch.Tensor)]))
check(state[0] == state[1], "optimizer state differs between ranks")
save_checkpoint(path, model, opt)
train(model, opt, range(5, 60))
opt.flush()
final = [p.detach().clone() for p in model.parameters()]
ends = comm.allgather_obj(digest(final))
check(ends[0] == ends[1], "weights differ between ranks after flush()")
with torch.no_grad():
    end = sum(loss_of(model, 10_000 + i, 0).item() for i in range(4))
check(end < 0.2 * start, f"did not converge: held-out loss {start:.4f} -> {end:.4f}")

model2, opt2 = build(7)
load_checkpoint(path, model2, opt2)
check(digest(model2.parameters()) == predicted[r], "resumed model is not this rank's predicted weights")
train(model2, opt2, range(5, 60))
opt2.flush()
for i, (a, b) in enumerate(zip(final, model2.parameters())):
    check(torch.equal(a, b), f"parameter {i} differs after resuming from the checkpoint")

try:
    build(0, mode="compensated" if r == 0 else "stale")
except SettingsMismatchError as e:
    check("double_buffering" in str(e), e)
else:
    check(False, "ranks with different double_buffering modes did not raise")
print(f"compensated ok {r} {start:.3f}->{end:.4f}")
"""


def _check(out):
    assert [o.split()[:3] for o in out] == [
        ["compensated", "ok", "0"],
        ["compensated", "ok", "1"],
    ], out


def test_mpi_compensated_2_ranks(tmp_path):
    _check(run_mpi(SCRIPT, 2, args=["mpi", str(tmp_path / "ckpt")], timeout=240))


def test_torch_gloo_compensated_2_ranks(tmp_path):
    _check(run_torch(SCRIPT, 2, args=["torch", str(tmp_path / "ckpt")], timeout=240))
