"""``compression="auto"`` on 2 gloo ranks: one plan on every rank, training, resume.

Rank 0 alone is given the link's rate (rank 1 takes it from rank 0); each mode (overlap,
double buffering, compensated) measures 2 steps, decides, trains, saves a checkpoint and
resumes it into a fresh optimizer, which takes the recorded plan. Without a rate the link is
probed. Ranks that disagree on ``"auto"`` raise ``SettingsMismatchError``.
"""

import pytest

from tests.multirank import run_torch

pytestmark = pytest.mark.distributed

TRAIN = r"""
import io
import torch, torch.distributed as dist
import commopt
from commopt.optim import create_multi_node_optimizer
from commopt.optim.fingerprint import SettingsMismatchError

comm = commopt.create_communicator("torch")
rank = comm.rank


def model_():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Flatten(),
                               torch.nn.Linear(32 * 4, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 64))


def build(model, double_buffering, rate="1mbit"):
    return create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm, model=model,
        compression="auto", auto_link_rate=rate if rank == 0 else None, auto_measure_steps=2,
        double_buffering=double_buffering)


def train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randint(0, 64, (8, 4), generator=g), torch.randint(0, 64, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_both(t, what):
    both = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(both, t)
    assert torch.equal(both[0], both[1]), f"rank {rank}: {what} differs between the ranks"


for db in (False, True, "compensated"):
    model = model_()
    opt = build(model, db)
    train(model, opt, range(3))
    plan = opt.auto_plan
    assert plan is not None, f"rank {rank} {db}: no plan after the measured steps"
    texts = comm.allgather_obj(plan.to_json())
    assert texts[0] == texts[1], f"rank {rank} {db}: the ranks' plans differ"
    assert plan.choices["2.weight"] != "none", f"rank {rank} {db}: {plan.choices}"
    train(model, opt, range(3, 5))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, range(5, 8))
    opt.flush()
    same_on_both(flat(model), f"{db}: the weights")
    assert torch.isfinite(flat(model)).all(), f"rank {rank} {db}: non-finite weights"

    model2 = model_()
    model2.load_state_dict(saved)
    opt2 = build(model2, db, rate="1tbit")  # a new decision would keep everything exact
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    assert opt2.auto_plan == plan, f"rank {rank} {db}: the resumed plan differs"
    train(model2, opt2, range(5, 8))
    opt2.flush()
    assert torch.equal(flat(model), flat(model2)), (
        f"rank {rank} {db}: the resumed run differs by {(flat(model) - flat(model2)).abs().max()}")
    opt.close(); opt2.close()

# No rate anywhere: a probe of the link (loopback here) at construction.
model = model_()
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), comm,
                                  model=model, compression="auto", auto_measure_steps=1)
train(model, opt, range(3))
assert opt.auto_plan is not None and opt.auto_plan.inputs["link_rate"] > 0
texts = comm.allgather_obj(opt.auto_plan.to_json())
assert texts[0] == texts[1], f"rank {rank}: the probed plans differ"
same_on_both(flat(model), "probed: the weights")
opt.close()

# One rank "auto", the other a codec: every rank raises SettingsMismatchError.
model = model_()
try:
    create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), comm,
                                model=model, compression="auto" if rank == 0 else "qsgd4")
except SettingsMismatchError as err:
    assert "auto" in str(err), f"rank {rank}: {err}"
else:
    raise AssertionError(f"rank {rank}: no SettingsMismatchError")
print("ok", rank)
"""


def test_auto_plan_two_gloo_ranks():
    out = run_torch(TRAIN, nprocs=2, timeout=300)
    assert [line.split()[:2] for line in out] == [["ok", "0"], ["ok", "1"]], out
