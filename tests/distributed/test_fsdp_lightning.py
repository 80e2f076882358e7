"""Lightning's ModelParallelStrategy with commopt between nodes, on 4 CPU ranks (2 x 2).

The LightningModule shards itself on the node's ranks in ``configure_model`` and keeps its
``compress_replicas``; ``optimizer_step`` applies ``replicas.step``. With
``model_parallel_strategy`` a checkpoint written by ModelCheckpoint after the first epoch
resumes (``ckpt_path=``) to exactly the uninterrupted run's weights, each rank restoring its
own error-feedback residuals; Lightning's own strategy, which does not save them, resumes
elsewhere (the residuals matter, so the check can fail).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.multirank import run_torch

# Found, not imported (see test_lightning.py).
if importlib.util.find_spec("lightning") is None:
    pytest.skip("pip install 'lightning==2.6.6' (scripts/setup.sh does)", allow_module_level=True)

pytestmark = pytest.mark.distributed

SCRIPT = r"""
import glob, sys, warnings
import torch
import torch.distributed as dist
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from commopt.integrations.fsdp import compress_replicas, model_parallel_strategy

warnings.filterwarnings("ignore", module="lightning")
tmp = sys.argv[1]


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 300), torch.nn.Tanh(), torch.nn.Linear(300, 1))
        self.replicas = None

    def configure_model(self):
        if self.replicas is not None:
            return
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for m in (self.net[0], self.net[2], self.net):
            fully_shard(m, mesh=mesh["shard"])
        self.replicas = compress_replicas(self.net, mesh["replicate"], "qsgd4+ef")

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer_closure()  # forward and backward: the replicas' average is in .grad
        self.replicas.step(optimizer)  # skipped on every rank if some rank had NaN/Inf

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


g = torch.Generator().manual_seed(1)
x = torch.randn(128, 32, generator=g)
y = torch.tanh(x[:, :4]).sum(1, keepdim=True)


def fit(epochs, strategy=model_parallel_strategy, callbacks=(), ckpt_path=None):
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_epochs=epochs, logger=False,
        strategy=strategy(data_parallel_size=4, tensor_parallel_size=1),
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(callbacks), callbacks=list(callbacks))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model, torch.cat([p.to_local().detach().reshape(-1) for p in model.net.parameters()])


_, whole = fit(2)
rank = dist.get_rank()  # (Lightning made the process group)
fit(1, callbacks=[ModelCheckpoint(dirpath=tmp, save_top_k=-1)])
ckpt = sorted(glob.glob(f"{tmp}/*.ckpt"))[-1]
model, resumed = fit(2, ckpt_path=ckpt)
assert model.replicas.step_number == 8, model.replicas.step_number
diff = (whole - resumed).abs().max().item()
assert torch.equal(whole, resumed), f"rank {rank}: the resumed run differs by {diff}"
_, plain = fit(2, strategy=ModelParallelStrategy, ckpt_path=ckpt)
assert not torch.equal(whole, plain), f"rank {rank}: resuming without the residuals changed nothing"
print("ok", rank)
"""


def test_lightning_model_parallel_resumes_bit_identical(tmp_path):
    out = run_torch(SCRIPT, 4, timeout=300, args=[str(tmp_path)])
    assert [o.strip().splitlines()[-1] for o in out] == [f"ok {r}" for r in range(4)]
