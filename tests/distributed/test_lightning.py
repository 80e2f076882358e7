"""A real ``lightning.Trainer`` on 2 CPU processes (gloo) with commopt's strategies.

One rank script (Lightning's import is the slow part) trains a small regression model:

- plain DDP, then ``CommoptStrategy(qsgd4+ef, double buffering)``: the losses differ from
  DDP's (the compression is active) and both ranks end with bit-identical parameters;
- a checkpoint written by Lightning's ModelCheckpoint after the first epoch resumes
  (``ckpt_path=``, fresh model, each rank its own error-feedback residuals) to exactly the
  parameters of the uninterrupted run;
- ``accumulate_grad_batches=2`` with ``gradient_clip_val``: CommoptStrategy without
  compression ends where DDP ends (within float rounding), and clipping changed the result;
- compensated double buffering trains with the ranks identical; value clipping, which would
  clip each rank's local gradients under double buffering, is refused with the fix;
- ``CommoptHookStrategy`` runs commopt's DDP hook on CPU (the losses differ from DDP's), and
  Lightning's own DDPStrategy given the hook on CPU (which would drop it) raises, naming the fix;
- ``double_buffering=True`` as a new user writes it (a 3-layer MLP classifier, SGD lr 0.05
  momentum 0.9, 64 steps): the final loss is within 2% of Lightning's own DDP, with and
  without ``qsgd4+ef``, while the plain stale schedule (``double_buffering="stale"``) ends
  more than 10% above it on the same run;
- (a second rank script, with the same model and helpers) local steps
  (``schedule="local_steps"``), each against the same run written as a direct
  commopt loop on the same shards (equal bit for bit; with clipping within float rounding):
  ``sync_every=3`` (the ranks' weights differ between synchronisations and agree at each;
  validation, between synchronisations, runs at the anchor, identical on both ranks; the end
  of training synchronises, so the trained model is the same on both ranks); accumulation
  with ``gradient_clip_val`` (each rank's inner step clipped); streaming (overlap 2 steps,
  ``qsgd4+ef``) whose epoch checkpoint at step 4, inside a cycle and with a reduction in
  flight, holds the anchor in Lightning's file and resumes exactly.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.multirank import run_torch

# Found, not imported: importing Lightning here would import triton compiled for the GPU
# into pytest's process, before commopt's kernels can ask for its CPU interpreter.
if importlib.util.find_spec("lightning") is None:
    pytest.skip("pip install 'lightning==2.6.6' (scripts/setup.sh does)", allow_module_level=True)

pytestmark = pytest.mark.distributed

PRELUDE = r"""
import contextlib, glob, os, sys, warnings
import torch
import torch.distributed as dist
import lightning as L
import commopt
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from commopt.integrations.ddp import CommoptHookState, commopt_hook
from commopt.integrations.lightning import CommoptHookStrategy, CommoptStrategy, rank_state_path

warnings.filterwarnings("ignore", module="lightning")  # its hints about workers, logging
tmp = sys.argv[1]


class Net(L.LightningModule):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        self.losses = []

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g)
    y = torch.tanh(x[:, :4]).sum(1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def fit(strategy, model=None, epochs=2, callbacks=(), ckpt_path=None, val=None, train=None, **kw):
    model = model or Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=bool(callbacks), callbacks=list(callbacks), **kw,
    )
    trainer.fit(model, train or data(), val, ckpt_path=ckpt_path)
    model.optimizer = trainer.optimizers[0]
    return model


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def same_on_ranks(model, what):
    mine = flat(model)
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    assert torch.equal(both[0], both[1]), f"rank {r}: {what}: the ranks' parameters differ"
"""

SCRIPT = r"""
# 1. compression is active, the ranks stay identical, a checkpoint resumes exactly
ddp = fit("ddp")
r = dist.get_rank()
ckpts = ModelCheckpoint(dirpath=tmp, save_top_k=-1, every_n_epochs=1)
run = fit(CommoptStrategy("qsgd4+ef", double_buffering=True), callbacks=[ckpts])
same_on_ranks(run, "qsgd4+ef")
assert run.losses != ddp.losses, f"rank {r}: qsgd4+ef gave DDP's losses: no compression"
gap = abs(sum(run.losses) - sum(ddp.losses))
assert gap > 1e-4, f"rank {r}: qsgd4+ef's losses are within {gap} of DDP's"
first = os.path.join(tmp, "epoch=0-step=4.ckpt")
assert os.path.exists(rank_state_path(first, r)), f"rank {r}: no per-rank state: {os.listdir(tmp)}"
resumed = fit(
    CommoptStrategy("qsgd4+ef", double_buffering=True), model=Net(seed=5), ckpt_path=first
)
assert torch.equal(flat(resumed), flat(run)), (
    f"rank {r}: resumed from {first}: {(flat(resumed) - flat(run)).abs().max()} from the run"
)

# 2. accumulation and clipping keep their meaning (no compression: DDP's result)
acc = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
ddp_acc = fit("ddp", **acc)
ours = fit(CommoptStrategy(), gradient_clip_algorithm="norm", **acc)
same_on_ranks(ours, "accumulation + clipping")
assert ours.optimizer.last_grad_norm is not None, f"rank {r}: commopt did not clip"
assert torch.allclose(flat(ours), flat(ddp_acc), rtol=1e-5, atol=1e-6), (
    f"rank {r}: accumulation + clipping: {(flat(ours) - flat(ddp_acc)).abs().max()} from DDP"
)
unclipped = fit("ddp", accumulate_grad_batches=2)
assert not torch.allclose(flat(unclipped), flat(ddp_acc)), f"rank {r}: the clip changed nothing"

# 3. compensated double buffering
comp = fit(CommoptStrategy("qsgd4+ef", double_buffering="compensated"))
same_on_ranks(comp, "compensated")

# value clipping where the gradients are still local when Lightning clips: refused
try:
    fit(
        CommoptStrategy(double_buffering=True), epochs=1,
        gradient_clip_val=0.1, gradient_clip_algorithm="value",
    )
    raise AssertionError(f"rank {r}: value clipping of local gradients was accepted")
except ValueError as e:
    assert "gradient_clip_algorithm='norm'" in str(e), e

# 4. the DDP hook path: on CPU through CommoptHookStrategy; refused through DDPStrategy
net = Net()
hook_ckpts = ModelCheckpoint(dirpath=os.path.join(tmp, "hook"), save_top_k=-1)
hooked = fit(
    CommoptHookStrategy(CommoptHookState("qsgd4+ef", model=net)), model=net, epochs=1,
    callbacks=[hook_ckpts],
)
same_on_ranks(hooked, "CommoptHookStrategy")
assert hooked.losses != ddp.losses[: len(hooked.losses)], f"rank {r}: the hook did not run"
saved = torch.load(rank_state_path(hook_ckpts.best_model_path, r), weights_only=True)["hook"]
assert saved["codecs"], f"rank {r}: the hook's checkpoint part holds no residuals: {saved}"
net = Net()
dropped = DDPStrategy(ddp_comm_hook=commopt_hook, ddp_comm_state=CommoptHookState(model=net))
try:
    fit(dropped, model=net)
    raise AssertionError(f"rank {r}: DDPStrategy dropped commopt's hook on CPU silently")
except RuntimeError as e:
    assert "CommoptHookStrategy" in str(e), e

# 5. double_buffering=True keeps DDP's accuracy (the compensated schedule); "stale" does not
class MLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 4),
        )

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


g = torch.Generator().manual_seed(1)
centers = torch.randn(4, 20, generator=g)
labels = torch.randint(0, 4, (2048,), generator=g)
points = centers[labels] + 2.0 * torch.randn(2048, 20, generator=g)  # overlapping classes


def final_loss(strategy):
    model = MLP()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(points, labels), batch_size=16
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=64, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=False,
    )
    trainer.fit(model, loader)
    assert trainer.global_step == 64, trainer.global_step
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model.net(points), labels).item()


reference = final_loss("ddp")
for name, strategy in (
    ("double_buffering=True", CommoptStrategy(double_buffering=True)),
    ("qsgd4+ef, double_buffering=True", CommoptStrategy("qsgd4+ef", double_buffering=True)),
):
    loss = final_loss(strategy)
    assert abs(loss / reference - 1) <= 0.02, (
        f"rank {r}: {name}: final loss {loss:.4f}, Lightning's DDP {reference:.4f}"
    )
stale = final_loss(CommoptStrategy(double_buffering="stale"))
assert stale / reference - 1 > 0.10, f"rank {r}: stale {stale:.4f}, DDP {reference:.4f}"
if r == 0:
    print(f"final loss: DDP {reference:.4f}, double_buffering=True {loss:.4f} (qsgd4+ef), "
          f"stale {stale:.4f}", file=sys.stderr)
print("ok", r)
"""

LOCAL_STEPS = r"""
r = int(os.environ["RANK"])

# Local steps (DiLoCo): the ranks' weights differ between synchronisations and agree at
# each; validation and Lightning's checkpoint file see the anchor; the end of training
# synchronises; all as a direct commopt loop on the same data; a mid-cycle resume is exact

class Watch(L.Callback):
    def __init__(self, every=None):  # every: the sync period (None: overlap merges)
        self.every, self.differed, self.anchors = every, [], {}

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        mine = flat(module)
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        step = trainer.global_step
        schedule = trainer.optimizers[0].schedule
        self.anchors[step] = torch.cat([a.flatten() for a in schedule.anchor]).clone()
        if self.every is None:
            return
        if step % self.every == 0:
            assert torch.equal(both[0], both[1]), f"rank {r}: step {step}: no agreement at a sync"
        else:
            self.differed.append(not torch.equal(both[0], both[1]))


class ValNet(Net):
    def validation_step(self, batch, i):
        anchor = torch.cat([a.flatten() for a in self.trainer.optimizers[0].schedule.anchor])
        assert torch.equal(flat(self), anchor), f"rank {r}: validation is not at the anchor"
        same_on_ranks(self, "validation between synchronisations")


def shard():
    # Each rank's half of data(), in order (handed to Lightning as is: no sampler of its own)
    dataset = data().dataset
    sampler = torch.utils.data.DistributedSampler(dataset, 2, r, shuffle=False)
    return torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)


def local_fit(strategy, **kw):
    return fit(strategy, train=shard(), use_distributed_sampler=False, **kw)


def direct(options, epochs=2, accumulate=1, clip=None):
    # The same run written as a commopt loop on the same shards.
    model = Net()
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        commopt.create_communicator("torch"), model=model, clip_grad_norm=clip, **options,
    )
    for _ in range(epochs):
        for i, (x, y) in enumerate(shard()):
            last = (i + 1) % accumulate == 0
            with contextlib.nullcontext() if last else opt.no_sync():
                (torch.nn.functional.mse_loss(model.net(x), y) / accumulate).backward()
            if last:
                opt.step()
                opt.zero_grad()
    opt.final_sync()
    opt.close()
    return model


diloco = dict(schedule="local_steps", sync_every=3)
watch = Watch(3)
local = local_fit(CommoptStrategy(**diloco), model=ValNet(), callbacks=[watch], val=data())
assert any(watch.differed), f"rank {r}: the ranks agreed between synchronisations: not local"
same_on_ranks(local, "after training (final synchronisation)")
oracle = direct(diloco)
assert torch.equal(flat(local), flat(oracle)), (
    f"rank {r}: Lightning local steps vs the commopt loop: "
    f"{(flat(local) - flat(oracle)).abs().max()}"
)

# accumulation and (inner, per-rank) clipping as the commopt loop does them
acc = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
clipped = local_fit(CommoptStrategy(schedule="local_steps", sync_every=2), **acc)
same_on_ranks(clipped, "local steps + accumulation + clipping")
assert clipped.optimizer.last_grad_norm is not None, f"rank {r}: commopt did not clip"
reference = direct(dict(schedule="local_steps", sync_every=2), accumulate=2, clip=0.05)
assert torch.allclose(flat(clipped), flat(reference), rtol=1e-6, atol=1e-7), (
    f"rank {r}: local steps with accumulation + clipping: "
    f"{(flat(clipped) - flat(reference)).abs().max()} from the commopt loop"
)

# mid-cycle resume: sync_every=3 with reductions overlapping 2 steps (sent after steps 1, 4,
# 7, applied, merged with the local weights, after 3, 6, 9) and 4-bit outer gradients with
# error feedback; the epoch's checkpoint at step 4 holds one in flight, and each rank's own
# weights, residuals and inner state in its own part; the end (step 8) merges the one sent
# after step 7, then synchronises
streaming = dict(schedule="local_steps", sync_every=3, overlap_steps=2)
where = os.path.join(tmp, "local")
watch = Watch()
ckpts = ModelCheckpoint(dirpath=where, save_top_k=-1, every_n_epochs=1)
run = local_fit(CommoptStrategy("qsgd4+ef", **streaming), callbacks=[ckpts, watch])
same_on_ranks(run, "streaming, after training")
first = os.path.join(where, "epoch=0-step=4.ckpt")
saved = torch.load(first, weights_only=True)["state_dict"]
assert torch.equal(torch.cat([v.flatten() for v in saved.values()]), watch.anchors[4]), (
    f"rank {r}: Lightning's checkpoint file does not hold the anchor"
)
resumed = local_fit(CommoptStrategy("qsgd4+ef", **streaming), model=Net(seed=5), ckpt_path=first)
assert torch.equal(flat(resumed), flat(run)), (
    f"rank {r}: resumed mid-cycle from {first}: {(flat(resumed) - flat(run)).abs().max()}"
)
assert torch.equal(flat(run), flat(direct({"compression": "qsgd4+ef", **streaming}))), (
    f"rank {r}: streaming under Lightning differs from the commopt loop"
)
print("ok", r)
"""


def test_lightning_trainer_on_two_cpu_ranks(tmp_path):
    out = run_torch(PRELUDE + SCRIPT, 2, timeout=420, args=[str(tmp_path)])
    assert out == ["ok 0\n", "ok 1\n"], out


def test_lightning_local_steps_on_two_cpu_ranks(tmp_path):
    out = run_torch(PRELUDE + LOCAL_STEPS, 2, timeout=240, args=[str(tmp_path)])
    assert out == ["ok 0\n", "ok 1\n"], out
