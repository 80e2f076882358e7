"""A real ``accelerate.Accelerator`` on 2 CPU processes (gloo) with commopt's optimizer.

One rank script trains a small regression model:

- Accelerate's own DDP, then :func:`commopt.integrations.accelerate.prepare_optimizer` with
  qsgd4+ef and double buffering: the losses differ from DDP's (the compression is active)
  and both ranks end with bit-identical parameters;
- ``accelerator.save_state`` after the first epoch, loaded into a fresh model and optimizer
  with ``accelerator.load_state``, resumes to exactly the uninterrupted run's parameters
  (each rank its own error-feedback residuals);
- ``accelerator.accumulate`` (2 micro-batches) with ``accelerator.clip_grad_norm_``: commopt
  without compression ends where Accelerate's DDP ends (within float rounding), and the
  clipping changed the result.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.multirank import run_torch

# Found, not imported: the rank script imports it (as the Lightning test does).
if importlib.util.find_spec("accelerate") is None:
    pytest.skip("pip install 'accelerate==1.15.0' (scripts/setup.sh does)", allow_module_level=True)

pytestmark = pytest.mark.distributed

SCRIPT = r"""
import os, sys
import torch
import torch.distributed as dist
from accelerate import Accelerator
from commopt.integrations.accelerate import prepare_optimizer, rank_state_file

tmp = sys.argv[1]


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    y = torch.tanh(x[:, :4]).sum(1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def train(commopt_options=None, epochs=2, seed=0, accumulate=1, clip=None, save=None, load=None):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if commopt_options is None:
        model, opt, loader = acc.prepare(model, opt, data())
    else:
        model, loader = acc.prepare(model, data())
        model, opt = prepare_optimizer(acc, model, opt, **commopt_options)
    start = 0
    if load is not None:
        acc.load_state(load)
        start = 1
    losses = []
    for epoch in range(start, epochs):
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                losses.append(loss.item())
                acc.backward(loss)
                if clip is not None and acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
        if save is not None and epoch == 0:
            acc.save_state(save)
    if commopt_options is not None:
        opt.optimizer.flush()  # double buffering: the last step's gradients
    return acc.unwrap_model(model), losses


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def same_on_ranks(model, what):
    mine = flat(model)
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    assert torch.equal(both[0], both[1]), f"rank {r}: {what}: the ranks' parameters differ"


# 1. compression is active, the ranks stay identical, save_state/load_state resume exactly
ddp, ddp_losses = train()
r = dist.get_rank()
qsgd = {"compression": "qsgd4+ef", "double_buffering": True}
state = os.path.join(tmp, "state")
run, losses = train(qsgd, save=state)
same_on_ranks(run, "qsgd4+ef")
gap = abs(sum(losses) - sum(ddp_losses))
assert gap > 1e-4, f"rank {r}: qsgd4+ef's losses are within {gap} of DDP's: no compression"
assert os.path.exists(os.path.join(state, rank_state_file(r))), os.listdir(state)
resumed, _ = train(qsgd, seed=5, load=state)
assert torch.equal(flat(resumed), flat(run)), (
    f"rank {r}: resumed: {(flat(resumed) - flat(run)).abs().max()} from the run"
)

# 2. accumulation and clipping keep their meaning (no compression: DDP's result)
ddp_acc, _ = train(accumulate=2, clip=0.05)
ours, _ = train({}, accumulate=2, clip=0.05)
same_on_ranks(ours, "accumulation + clipping")
assert torch.allclose(flat(ours), flat(ddp_acc), rtol=1e-5, atol=1e-6), (
    f"rank {r}: accumulation + clipping: {(flat(ours) - flat(ddp_acc)).abs().max()} from DDP"
)
unclipped, _ = train(accumulate=2)
assert not torch.allclose(flat(unclipped), flat(ddp_acc)), f"rank {r}: the clip changed nothing"
print("ok", r)
"""


def test_accelerator_on_two_cpu_ranks(tmp_path):
    out = run_torch(SCRIPT, 2, timeout=300, args=[str(tmp_path)])
    assert out == ["ok 0\n", "ok 1\n"], out
