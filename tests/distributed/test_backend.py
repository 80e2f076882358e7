"""The ``commopt`` torch.distributed backend under a plain DDP script on 2 real processes.

The training script below is written as the PyTorch examples write one (DistributedSampler,
DDP, SGD with momentum, a StepLR schedule, gradient clipping, rank 0 saving a checkpoint)
and knows nothing of commopt: the runs differ only in the backend name, and the commopt
runs are launched as ``python -m commopt.integrations.backend train.py`` (what torchrun's
``-m`` does), so the script has no commopt import either.
"""

from __future__ import annotations

import json

import pytest

from tests.multirank import run_torch

pytestmark = pytest.mark.distributed

TRAIN = """
import argparse, hashlib, json
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    parser = argparse.ArgumentParser(description="synthetic classification with DDP")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", default="")
    args = parser.parse_args()

    dist.init_process_group(backend="BACKEND")
    rank = dist.get_rank()

    torch.manual_seed(0)
    inputs = torch.randn(1024, 32)
    labels = (inputs @ torch.randn(32, 4)).argmax(1)
    dataset = TensorDataset(inputs, labels)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)

    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
        scheduler.step()

    model.eval()
    with torch.no_grad():
        logits = model(inputs)
        total = torch.tensor([F.cross_entropy(logits, labels).item(),
                              (logits.argmax(1) == labels).float().mean().item()])
    dist.all_reduce(total)
    params = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    print(json.dumps({"rank": rank, "loss": total[0].item() / 2, "accuracy": total[1].item() / 2,
                      "params_sha": hashlib.sha256(params.numpy().tobytes()).hexdigest()}))
    if rank == 0 and args.checkpoint:
        torch.save(model.module.state_dict(), args.checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""

# ``python -m commopt.integrations.backend train.py ARGS``, then this rank's counters.
LAUNCH = """
import json, runpy, sys
runpy.run_module("commopt.integrations.backend", run_name="__main__", alter_sys=True)
import commopt.integrations.backend as backend
print("STATS " + json.dumps(backend.stats()))
"""


def _run(backend: str, tmp_path, env=None, launch_commopt=True):
    run = len(list(tmp_path.iterdir()))
    ckpt, script = tmp_path / f"{backend}-{run}.pt", tmp_path / f"train-{run}.py"
    script.write_text(TRAIN.replace('"BACKEND"', repr(backend)))
    args = ["--checkpoint", str(ckpt)]
    if launch_commopt:
        outs = run_torch(LAUNCH, 2, timeout=240, env=env, args=[str(script), *args])
    else:
        outs = run_torch(script.read_text(), 2, timeout=240, env=env, args=args)
    results, stats = [], []
    for rank, out in enumerate(outs):
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert lines, f"rank {rank} printed no result: {out!r}"
        results.append(json.loads(lines[-1]))
        stats.append(json.loads(out.split("STATS ", 1)[1]) if "STATS " in out else None)
    assert results[0]["params_sha"] == results[1]["params_sha"], (
        f"{backend}: ranks ended with different parameters: {results}"
    )
    import torch

    return results[0], stats, torch.load(ckpt)


def _distance(a: dict, b: dict) -> float:
    import torch

    flat = lambda sd: torch.cat([v.reshape(-1) for v in sd.values()])  # noqa: E731
    return float((flat(a) - flat(b)).norm() / flat(b).norm())


@pytest.mark.slow
def test_unmodified_ddp_script_trains_compressed_under_the_commopt_backend(tmp_path):
    exact, _, exact_ckpt = _run("gloo", tmp_path, launch_commopt=False)
    assert exact["accuracy"] > 0.8, f"the plain gloo run did not learn: {exact}"

    # COMMOPT_BITS=32: every allreduce passes through to gloo, bit for bit plain DDP.
    same, stats32, _same_ckpt = _run("commopt", tmp_path, env={"COMMOPT_BITS": "32"})
    assert same["params_sha"] == exact["params_sha"], "COMMOPT_BITS=32 must equal gloo exactly"
    assert stats32[0]["compressed_calls"] == 0 and stats32[0]["sent_bytes"] == 0, stats32

    comp, stats4, comp_ckpt = _run("commopt", tmp_path, env={"COMMOPT_BITS": "4"})
    for rank, s in enumerate(stats4):
        # 3 epochs x 16 steps, one DDP bucket of 4,740 fp32 elements each
        assert s["compressed_calls"] >= 48, f"rank {rank}: too few compressed allreduces: {s}"
        fp32_bytes = 4 * s["compressed_elements"]
        assert s["sent_bytes"] < 0.3 * fp32_bytes, (
            f"rank {rank}: sent {s['sent_bytes']} bytes for {fp32_bytes} fp32 bytes: not compressed"
        )
    assert comp["params_sha"] != exact["params_sha"], (
        "4-bit run is bit-identical to fp32: no codec ran"
    )
    dist = _distance(comp_ckpt, exact_ckpt)
    assert 0 < dist < 0.25, f"4-bit parameters {dist:.3f} (relative L2) away from fp32 DDP"
    assert comp["loss"] < exact["loss"] * 1.3 + 0.05, f"4-bit loss {comp} against fp32 {exact}"
    assert comp["accuracy"] > exact["accuracy"] - 0.05, f"4-bit {comp} against fp32 {exact}"


REGISTERED = """
import json, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import commopt.integrations.backend as backend

dist.init_process_group("commopt")
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
model = DDP(net)
if {register}:
    state = backend.register_model(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(rank)
for step in range(20):
    x = torch.randn(32, 32, generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), (x[:, :4]).argmax(1))
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 0: first = loss.item()
flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
print(json.dumps({{"first": first, "last": loss.item(), "sum": flat.double().sum().item(),
                  "stats": backend.stats(), "residuals": len(state.state_dict()["codecs"])}}))
dist.destroy_process_group()
"""


def test_register_model_reduces_layer_by_layer_with_error_feedback():
    outs = run_torch(
        REGISTERED.format(register=True),
        2,
        timeout=180,
        env={"COMMOPT_BITS": "4", "COMMOPT_ERROR_FEEDBACK": "1"},
    )
    rows = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert rows[0]["sum"] == rows[1]["sum"], f"ranks differ: {rows}"
    for rank, row in enumerate(rows):
        assert row["last"] < row["first"], f"rank {rank} did not learn: {row}"
        # the hook's traffic goes through commopt's transport, not the bucket path
        assert row["stats"]["compressed_calls"] == 0 and row["stats"]["sent_bytes"] > 0, row
        assert row["residuals"] >= 1, f"rank {rank}: no error-feedback state: {row}"


def test_error_feedback_without_register_model_fails_with_the_fix():
    with pytest.raises(AssertionError, match="register_model"):
        run_torch(
            REGISTERED.format(register=False),
            2,
            timeout=120,
            env={"COMMOPT_BITS": "4", "COMMOPT_ERROR_FEEDBACK": "1"},
        )


HIERARCHICAL = """
import json, os, torch, torch.distributed as dist
os.environ["COMMOPT_NODE_NAME"] = "node%d" % (int(os.environ["RANK"]) // 2)  # 2 nodes x 2 ranks
import commopt.integrations.backend as backend
from commopt import collectives

dist.init_process_group("commopt")
rank, pg = dist.get_rank(), dist.group.WORLD
x = torch.randn(20000, generator=torch.Generator().manual_seed(rank))
exact = sum(torch.randn(20000, generator=torch.Generator().manual_seed(r)) for r in range(4))
dist.all_reduce(x)
print(json.dumps({"algorithm": collectives.choose_algorithm(pg.comm, pg._codec),
                  "nodes": [pg.comm.inter_size, pg.comm.intra_size],
                  "err": float((x - exact).abs().max()), "scale": float(exact.abs().max()),
                  "sum": float(x.double().sum()), "stats": backend.stats()}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ranks_on_several_nodes_reduce_hierarchically():
    outs = run_torch(HIERARCHICAL, 4, timeout=240, env={"COMMOPT_BITS": "8"})
    rows = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert len({r["sum"] for r in rows}) == 1, f"ranks differ: {rows}"
    for rank, row in enumerate(rows):
        assert row["algorithm"] == "hierarchical" and row["nodes"] == [2, 2], row
        # 8-bit QSGD of the node sums (2 draws each): within a few levels of the max scale
        assert 0 < row["err"] < 0.05 * row["scale"], f"rank {rank}: {row}"
        assert row["stats"]["compressed_calls"] == 1 and row["stats"]["sent_bytes"] > 0, row


# Every collective other than a compressed allreduce, after allreduces whose tensors nobody
# keeps (gloo frees each finished work, and with it a tensor that has a Python object, while
# it holds its queue's lock): broadcast, allgather, all_gather_into_tensor, reduce_scatter,
# all_to_all_single, allreduce_coalesced, send/recv and barrier, each checked against its
# exact result, 300 times.
PASS_THROUGH = """
import json, torch, torch.distributed as dist
import commopt.integrations.backend as backend

dist.init_process_group("commopt")
rank, n = dist.get_rank(), dist.get_world_size()
bad = []
for i in range(300):
    for _ in range(4):
        dist.all_reduce(torch.ones(16), async_op=True)   # neither the tensor nor the work kept
    b = torch.full((3,), float(rank + i))
    dist.broadcast(b, 0)
    gathered = [torch.empty(2) for _ in range(n)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    flat = torch.empty(2 * n)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    part = torch.empty(2)
    dist.reduce_scatter_tensor(part, torch.arange(2.0 * n) + rank)
    swapped = torch.empty(n)
    dist.all_to_all_single(swapped, torch.full((n,), float(rank)))
    pair = [torch.ones(3), torch.full((2,), float(rank))]
    dist.all_reduce_coalesced(pair)
    got = torch.empty(1)
    if rank == 0:
        dist.send(torch.tensor([float(i)]), 1)
    elif rank == 1:
        dist.recv(got, 0)
    dist.barrier()
    expect_sum = sum(range(n))
    if not (torch.equal(b, torch.full((3,), float(i)))
            and [g.tolist() for g in gathered] == [[float(r)] * 2 for r in range(n)]
            and flat.tolist() == [float(r) for r in range(n) for _ in range(2)]
            and part.tolist() == [n * (2.0 * rank + k) + expect_sum for k in range(2)]
            and swapped.tolist() == [float(r) for r in range(n)]
            and pair[0].tolist() == [float(n)] * 3 and pair[1].tolist() == [float(expect_sum)] * 2
            and (rank != 1 or got.item() == i)):
        bad.append(i)
print(json.dumps({"rank": rank, "bad": bad[:5], "stats": backend.stats()}))
dist.destroy_process_group()
"""


def test_every_pass_through_collective_is_exact_and_never_waits_on_the_gil():
    # Before each collective had its override, rank 0 deadlocked within the first rounds: the
    # broadcast held the GIL waiting for gloo's queue, gloo held the queue freeing a tensor.
    outs = run_torch(PASS_THROUGH, 2, timeout=120, env={"COMMOPT_BITS": "32"})
    for rank, out in enumerate(outs):
        row = json.loads(out.strip().splitlines()[-1])
        assert row["bad"] == [], f"rank {rank}: wrong results at rounds {row['bad']}"
        assert row["stats"]["passthrough_calls"] >= 1200, row
