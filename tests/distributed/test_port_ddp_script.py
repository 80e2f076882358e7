"""A plain DDP training script, ported to commopt by a small textual diff, run on 2 real ranks.

``DDP_SCRIPT`` is written in the style of the PyTorch examples: ``DistributedSampler`` with
``set_epoch``, an MLP, bf16 autocast on CPU, ``clip_grad_norm_`` between ``backward()`` and
``step()``, ``StepLR``, rank 0 saving a checkpoint mid-run and a ``--resume`` that loads it in
new processes. ``PORT`` is the whole port: each entry replaces one exact piece of the DDP text
(this is the executable version of the diff in docs/porting.md, "From DDP").

Checked against the DDP run on the same data (2 ranks, gloo):
- the port under torch.distributed's launcher environment (communicator "torch") and under
  mpirun (communicator "mpi"), fp32 wire: final parameters within 1e-5 relative of DDP's;
- the port with ``--compression fp16``: within the fp16 codec's tolerance (1e-2 relative);
- the port resumed from its mid-run checkpoint in new processes: bit-identical to the
  uninterrupted run, on every rank.
"""

import difflib
import re

import pytest
import torch

from tests.multirank import run_mpi, run_torch

pytestmark = pytest.mark.distributed

DDP_SCRIPT = r"""
import argparse
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 64)
        self.fc3 = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def train(model, loader, optimizer, sampler, epoch):
    model.train()
    sampler.set_epoch(epoch)
    for data, target in loader:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(data), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
    return loss.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=None, help="checkpoint after this epoch")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--ckpt", default="checkpoint.pt")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 32, generator=g)
    y = (x @ torch.randn(32, 4, generator=g)).argmax(dim=1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    model = Net()
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.ckpt, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]

    for epoch in range(start_epoch, args.epochs):
        loss = train(model, loader, optimizer, sampler, epoch)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss:.4f}")
        if args.save_at == epoch + 1:
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch + 1}, args.ckpt)
            dist.barrier()

    torch.save(model.module.state_dict(), f"{args.out}.rank{rank}")


if __name__ == "__main__":
    main()
"""

# The port, piece by piece: (DDP text, commopt text). Each DDP piece occurs exactly once.
PORT = [
    (
        "from torch.nn.parallel import DistributedDataParallel as DDP\n",
        "import commopt\nfrom commopt.optim import load_checkpoint, save_checkpoint\n",
    ),
    (
        '    parser.add_argument("--out", required=True)\n',
        '    parser.add_argument("--out", required=True)\n'
        '    parser.add_argument("--comm", default="torch")         # "torch" (torchrun) or "mpi" (mpirun)\n'
        '    parser.add_argument("--compression", default=None)     # e.g. "fp16", "qsgd8"\n',
    ),
    (
        '    dist.init_process_group("gloo")\n'
        "    rank, world_size = dist.get_rank(), dist.get_world_size()\n",
        "    comm = commopt.create_communicator(args.comm)\n"
        "    rank, world_size = comm.rank, comm.size\n",
    ),
    (
        "    model = DDP(model)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n",
        "    optimizer = commopt.create_multi_node_optimizer(\n"
        "        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm, model=model,\n"
        "        compression=args.compression)\n",
    ),
    (
        '        ckpt = torch.load(args.ckpt, map_location="cpu")\n'
        '        model.load_state_dict(ckpt["model"])\n'
        '        optimizer.load_state_dict(ckpt["optimizer"])\n',
        "        ckpt = load_checkpoint(args.ckpt, model, optimizer)   # every rank\n",
    ),
    (
        "            if rank == 0:\n"
        '                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),\n'
        '                            "scheduler": scheduler.state_dict(), "epoch": epoch + 1}, args.ckpt)\n'
        "            dist.barrier()\n",
        "            save_checkpoint(args.ckpt, model, optimizer,           # every rank\n"
        '                            extra={"scheduler": scheduler.state_dict(), "epoch": epoch + 1})\n',
    ),
    (
        '    torch.save(model.module.state_dict(), f"{args.out}.rank{rank}")\n',
        '    torch.save(model.state_dict(), f"{args.out}.rank{rank}")\n',
    ),
]


def port(script: str) -> str:
    for old, new in PORT:
        assert script.count(old) == 1, f"the DDP script should hold this exactly once:\n{old}"
        script = script.replace(old, new)
    return script


COMMOPT_SCRIPT = port(DDP_SCRIPT)
FP32_TOL = 1e-5  # fp32 wire: only summation order may differ from DDP's
FP16_TOL = 1e-2  # fp16 wire: one rounding (2^-11 relative) of each averaged gradient, 32 steps


def changed_lines(a: str, b: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def test_the_port_is_a_small_diff():
    diff = changed_lines(DDP_SCRIPT, COMMOPT_SCRIPT)
    removed = [line for line in diff if line.startswith("-")]
    added = [line for line in diff if line.startswith("+")]
    assert len(removed) <= 14 and len(added) <= 14, "\n".join(diff)
    # Nothing of DDP or of the torch process group is left in the ported script.
    assert not re.search(r"\bDDP\b|\bdist\.|\.module\b", COMMOPT_SCRIPT), COMMOPT_SCRIPT
    # The training loop, sampler, scheduler, AMP and clipping lines are untouched.
    for unchanged in (
        "sampler.set_epoch(epoch)",
        "torch.autocast(",
        "clip_grad_norm_(",
        "StepLR(optimizer",
        "scheduler.load_state_dict(",
        "optimizer.step()",
    ):
        assert unchanged in COMMOPT_SCRIPT and not any(unchanged in line for line in diff), (
            unchanged
        )


def _final_params(out: str, nprocs: int = 2) -> list[torch.Tensor]:
    sds = [torch.load(f"{out}.rank{r}", map_location="cpu") for r in range(nprocs)]
    return [torch.cat([t.reshape(-1).float() for t in sd.values()]) for sd in sds]


def _run(
    launcher, script: str, tmp, name: str, *args: str, timeout: float = 60
) -> list[torch.Tensor]:
    out = str(tmp / name)
    run = run_mpi if launcher == "mpi" else run_torch
    stdout = run(script, nprocs=2, timeout=timeout, args=[*args, "--out", out])
    assert "epoch 3 loss" in stdout[0], stdout
    return _final_params(out)


@pytest.fixture(scope="module")
def ddp_params(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    params = _run("torch", DDP_SCRIPT, tmp, "ddp", "--save-at", "2", "--ckpt", str(tmp / "ckpt.pt"))
    assert torch.equal(params[0], params[1]), "DDP's ranks disagree: the reference is broken"
    return params[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("launcher", ["torch", "mpi"])
def test_port_matches_ddp_and_resumes_bit_exactly(launcher, ddp_params, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = _run(
        launcher,
        COMMOPT_SCRIPT,
        tmp_path,
        "full",
        "--comm",
        launcher,
        "--save-at",
        "2",
        "--ckpt",
        ckpt,
    )
    for r in range(2):
        assert torch.equal(full[r], full[0]), (
            f"{launcher}: rank {r}'s parameters differ from rank 0's"
        )
        err = _rel(full[r], ddp_params)
        assert err <= FP32_TOL, f"{launcher}: rank {r}: {err:.2e} relative from DDP's parameters"
    resumed = _run(
        launcher,
        COMMOPT_SCRIPT,
        tmp_path,
        "resumed",
        "--comm",
        launcher,
        "--resume",
        "--ckpt",
        ckpt,
    )
    for r in range(2):
        assert torch.equal(resumed[r], full[r]), (
            f"{launcher}: rank {r}: resumed from the epoch-2 checkpoint, the parameters differ "
            f"from the uninterrupted run by {_rel(resumed[r], full[r]):.2e} relative"
        )


def test_port_with_fp16_compression_within_codec_tolerance(ddp_params, tmp_path):
    got = _run(
        "torch", COMMOPT_SCRIPT, tmp_path, "fp16", "--comm", "torch", "--compression", "fp16"
    )
    assert torch.equal(got[0], got[1]), "fp16: the ranks' parameters differ"
    err = _rel(got[0], ddp_params)
    assert 0 < err <= FP16_TOL, (
        f"fp16: {err:.2e} relative from DDP's parameters (0 means nothing was compressed)"
    )
