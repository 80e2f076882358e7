"""Mixed per-group plans on 2 and 4 real ranks (mpirun and torch.distributed gloo).

Two plans per script: (a) the embedding reduced synchronously while the rest is compensated
double buffering with qsgd4+ef (a ``plans=`` name rule), (b) an fp16 synchronous group
beside a qsgd4 double-buffered group (parameter-group keys). For each: the ranks' true
weights stay bit-identical, a NaN on one rank is skipped by every rank at the same step,
a run resumed from a mid-run ``save_checkpoint`` ends bit for bit where the uninterrupted
run ends, ranks whose plans differ raise ``SettingsMismatchError`` naming the group, and
``Join`` keeps ranks with uneven data equal.
Every failure names its rank.
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
r, n = comm.rank, comm.size
NAN_STEP, NAN_RANK = 5, n - 1


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def forward(self, idx):
        return self.body(self.embed(idx))


def build(case, seed, rules=True):
    torch.manual_seed(seed + 10 * r)   # differs per rank: the wrapper broadcasts rank 0's
    model = Net()
    policy = CompressionPolicy(min_compress_numel=64)
    if case == "a":
        opt = create_multi_node_optimizer(
            torch.optim.AdamW(model.parameters(), lr=0.02), comm, model=model,
            double_buffering="compensated", compression="qsgd4+ef", policy=policy,
            clip_grad_norm=5.0, plans=[("embed.*", {"double_buffering": False})] if rules else None,
            synchronous_embeddings=rules)   # (the default rule would choose the same plan)
    else:
        groups = [{"params": list(model.embed.parameters()), "compression": "fp16"},
                  {"params": list(model.body.parameters())}]
        if rules:
            groups[1].update(compression="qsgd4", double_buffering="stale")
        opt = create_multi_node_optimizer(
            torch.optim.SGD(groups, lr=0.05, momentum=0.9), comm, model=model, policy=policy)
    return model, opt


def loss_of(model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, 32, (8,), generator=g)
    return (model(idx) - torch.randn(8, 4, generator=g)).pow(2).mean()


def train(model, opt, steps):
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)   # both gradient layouts (copies, bucket views)
        hook = None
        if step == NAN_STEP and r == NAN_RANK:   # a NaN in the synchronous plan of one rank
            hook = model.embed.weight.register_hook(lambda g: g * float("nan"))
        loss_of(model, step, r).backward()
        if hook is not None:
            hook.remove()
        opt.step()


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {r}: {what}")


for case in ("a", "b"):
    model, opt = build(case, 0)
    check(len(opt.plans) == 2, f"case {case}: plans {list(opt.plans)}")
    train(model, opt, range(4))
    with opt.true_weights():
        true = comm.allgather_obj(digest(model.parameters()))
    check(len(set(true)) == 1, f"case {case}: true weights differ between ranks")
    save_checkpoint(f"{path}-{case}", model, opt)
    train(model, opt, range(4, 10))
    skipped = comm.allgather_obj((opt.skipped_steps, opt.applied_steps))
    check(len(set(skipped)) == 1 and skipped[0][0] == 1, f"case {case}: NaN skips {skipped}")
    opt.flush()
    final = [p.detach().clone() for p in model.parameters()]
    ends = comm.allgather_obj(digest(final))
    check(len(set(ends)) == 1, f"case {case}: weights differ between ranks after flush()")
    check(all(torch.isfinite(p).all() for p in final), f"case {case}: non-finite weights")

    model2, opt2 = build(case, 7)
    load_checkpoint(f"{path}-{case}", model2, opt2)
    train(model2, opt2, range(4, 10))
    opt2.flush()
    for i, (a, b) in enumerate(zip(final, model2.parameters())):
        check(torch.equal(a, b), f"case {case}: parameter {i} differs after resuming")

    try:
        build(case, 0, rules=r != 0)
    except SettingsMismatchError as e:
        check("parameter group" in str(e), e)
    else:
        check(False, f"case {case}: ranks with different plans did not raise")
# Join over mixed plans: rank 0 has one batch more; the others shadow its last step.
model, opt = build("a", 0)
with commopt.Join(opt) as join:
    for step in range(3 if r == 0 else 2):
        opt.zero_grad()
        loss_of(model, step, r).backward()
        opt.step()
opt.flush()
ends = comm.allgather_obj(digest(model.parameters()))
check(len(set(ends)) == 1, "weights differ between ranks after Join")
check(join.shadow_steps == (0 if r == 0 else 1), f"shadow steps {join.shadow_steps}")
print(f"plans ok {r}")
"""


def _check(out, n):
    assert [o.split()[:3] for o in out] == [["plans", "ok", str(r)] for r in range(n)], out


@pytest.mark.parametrize("n", [2, 4])
def test_mpi_mixed_plans(tmp_path, n):
    _check(run_mpi(SCRIPT, n, args=["mpi", str(tmp_path / "ckpt")], timeout=300), n)


@pytest.mark.parametrize("n", [2, 4])
def test_torch_gloo_mixed_plans(tmp_path, n):
    _check(run_torch(SCRIPT, n, args=["torch", str(tmp_path / "ckpt")], timeout=300), n)
