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
  clipping changed the result;
- local steps (``schedule="local_steps"``), each against the same run written as a direct
  commopt loop on the same batches (equal bit for bit; with clipping within float rounding):
  ``sync_every=3`` (the ranks differ between synchronisations and agree at each, and after
  ``final_sync()``); accumulation with ``accelerator.clip_grad_norm_`` (each rank's inner
  step clipped); streaming (overlap 2 steps, ``qsgd4+ef``) saved after step 4, inside a
  cycle with a reduction in flight: the model file holds the anchor and ``load_state``
  resumes exactly.
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
import contextlib, os, sys
import torch
import torch.distributed as dist
from accelerate import Accelerator
from safetensors.torch import load_file
import commopt
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


def train(
    commopt_options=None, epochs=2, seed=0, accumulate=1, clip=None, save=None, load=None,
    seen=None, each_step=None,
):
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
            if seen is not None:
                seen.append((x.clone(), y.clone()))
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                losses.append(loss.item())
                acc.backward(loss)
                if clip is not None and acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
                if each_step is not None and acc.sync_gradients:
                    each_step(model, opt.optimizer)
        if save is not None and epoch == 0:
            acc.save_state(save)
    if commopt_options is not None:
        # double buffering: the last step's gradients; local steps: a last synchronisation
        opt.optimizer.final_sync()
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

# 3. local steps (DiLoCo): the ranks differ between synchronisations and agree at each;
# the end of training synchronises; all as a direct commopt loop on the same batches


def direct(options, batches, accumulate=1, clip=None):
    model = make_model()
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        commopt.create_communicator("torch"), model=model, clip_grad_norm=clip, **options,
    )
    for i, (x, y) in enumerate(batches):
        last = (i + 1) % accumulate == 0
        with contextlib.nullcontext() if last else opt.no_sync():
            (torch.nn.functional.mse_loss(model(x), y) / accumulate).backward()
        if last:
            opt.step()
            opt.zero_grad()
    opt.final_sync()
    opt.close()
    return model


class Watch:
    def __init__(self, every=None):  # every: the sync period (None: overlap merges)
        self.every, self.step, self.differed, self.anchors = every, 0, [], {}

    def __call__(self, model, opt):
        self.step += 1
        mine = flat(model)
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        self.anchors[self.step] = torch.cat([a.flatten() for a in opt.schedule.anchor]).clone()
        if self.every is None:
            return
        if self.step % self.every == 0:
            assert torch.equal(both[0], both[1]), f"rank {r}: step {self.step}: no agreement"
        else:
            self.differed.append(not torch.equal(both[0], both[1]))


diloco = {"schedule": "local_steps", "sync_every": 3}
seen, watch = [], Watch(3)
local, _ = train(diloco, seen=seen, each_step=watch)
assert watch.step == 8 and any(watch.differed), f"rank {r}: no local steps: {watch.differed}"
same_on_ranks(local, "local steps, after final_sync()")
oracle = direct(diloco, seen)
assert torch.equal(flat(local), flat(oracle)), (
    f"rank {r}: local steps under Accelerate vs the commopt loop: "
    f"{(flat(local) - flat(oracle)).abs().max()}"
)
assert not torch.allclose(flat(local), flat(ddp)), f"rank {r}: local steps gave DDP's weights"

# accumulation and accelerator.clip_grad_norm_ (each rank's own gradients, the inner step's)
seen, every2 = [], {"schedule": "local_steps", "sync_every": 2}
clipped, _ = train(every2, accumulate=2, clip=0.05, seen=seen)
same_on_ranks(clipped, "local steps + accumulation + clipping")
reference = direct(every2, seen, accumulate=2, clip=0.05)
assert torch.allclose(flat(clipped), flat(reference), rtol=1e-6, atol=1e-7), (
    f"rank {r}: local steps, accumulation + clipping: "
    f"{(flat(clipped) - flat(reference)).abs().max()} from the commopt loop"
)
unclipped = direct(every2, seen, accumulate=2)
assert not torch.allclose(flat(unclipped), flat(clipped)), f"rank {r}: the clip changed nothing"

# mid-cycle resume: sync_every=3, reductions overlapping 2 steps (sent after steps 1, 4, 7)
# with 4-bit outer gradients and error feedback; saved after step 4 (one in flight); the
# model file holds the anchor, each rank's part its own weights, residuals and inner state
streaming = {
    "schedule": "local_steps", "sync_every": 3, "overlap_steps": 2, "compression": "qsgd4+ef"
}
state = os.path.join(tmp, "local")
seen, watch = [], Watch()
run, _ = train(streaming, save=state, seen=seen, each_step=watch)
same_on_ranks(run, "streaming, after final_sync()")
saved = load_file(os.path.join(state, "model.safetensors"))
saved = {k.removeprefix("module."): v for k, v in saved.items()}  # (DDP's names)
saved = torch.cat([saved[name].flatten() for name, _ in run.named_parameters()])
assert torch.equal(saved, watch.anchors[4]), (
    f"rank {r}: Accelerate's model file does not hold the anchor"
)
resumed, _ = train(streaming, seed=5, load=state)
assert torch.equal(flat(resumed), flat(run)), (
    f"rank {r}: resumed mid-cycle: {(flat(resumed) - flat(run)).abs().max()} from the run"
)
assert torch.equal(flat(run), flat(direct(streaming, seen))), (
    f"rank {r}: streaming under Accelerate differs from the commopt loop"
)
print("ok", r)
"""


def test_accelerator_on_two_cpu_ranks(tmp_path):
    out = run_torch(SCRIPT, 2, timeout=300, args=[str(tmp_path)])
    assert out == ["ok 0\n", "ok 1\n"], out
