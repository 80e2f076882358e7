"""commopt's DDP comm hook on 2 gloo ranks: equal to plain DDP in fp32, close in fp16/qsgd4."""

import pytest

from tests.multirank import run_torch

pytestmark = pytest.mark.distributed

BODY = """
import copy, io, pickle, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import commopt
from commopt.integrations.ddp import CommoptHookState, commopt_hook

comm = commopt.create_communicator("torch")     # creates the default gloo group
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64),
                          torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))

def train(compression, steps=6, bucket_cap_mb=0.01):
    model = copy.deepcopy(net)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    state = None
    if compression is not None:
        state = CommoptHookState(compression, model=model)
        ddp.register_comm_hook(state, commopt_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g); y = torch.randn(32, 8, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, state, losses

def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

ref, _, ref_losses = train(None)
fp32, _, _ = train("none")
assert torch.equal(flat(ref), flat(fp32)), f"rank {rank}: fp32 hook differs from DDP by {(flat(ref)-flat(fp32)).abs().max()}"

half, _, _ = train("fp16")
err = ((flat(half) - flat(ref)).abs().max() / flat(ref).abs().max()).item()
assert err < 1e-3, f"rank {rank}: fp16 hook relative error {err}"

q, state, q_losses = train("qsgd4+ef", steps=30)
ref30, _, ref30_losses = train(None, steps=30)
assert q_losses[-1] < 0.8 * q_losses[0], f"rank {rank}: qsgd4+ef not converging {q_losses[0]} -> {q_losses[-1]}"
gap = abs(q_losses[-1] - ref30_losses[-1]) / ref30_losses[-1]
assert gap < 0.1, f"rank {rank}: qsgd4+ef final loss {q_losses[-1]} vs fp32 {ref30_losses[-1]}"

# The parameters stay identical on both ranks (every rank decodes the same bytes).
mine = flat(q); others = [torch.empty_like(mine) for _ in range(2)]
dist.all_gather(others, mine)
assert torch.equal(others[0], others[1]), f"rank {rank}: ranks diverged under qsgd4+ef"

# Checkpointable: plain state, no process group; pickling drops the communicator.
sd = state.state_dict()
buf = io.BytesIO(); torch.save(sd, buf)
assert sd["reduction"] == 30 and any(v for v in sd["codecs"].values()), sd.keys()
clone = pickle.loads(pickle.dumps(state))
assert clone._comm is None and clone.process_group is None and clone.reduction == 30
fresh = CommoptHookState("qsgd4+ef"); fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
assert fresh.reduction == 30
print("ok", rank)
"""


def test_ddp_hook_matches_ddp_and_converges():
    out = run_torch(BODY, 2, timeout=240)
    assert [o.strip() for o in out] == ["ok 0", "ok 1"]


def test_unknown_compression_fails_at_construction():
    from commopt.integrations.ddp import CommoptHookState

    with pytest.raises(ValueError):
        CommoptHookState("qsgd3000")
