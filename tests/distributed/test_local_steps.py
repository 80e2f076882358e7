"""The local-steps schedule on 2 and 4 real ranks (torch.distributed gloo, and mpirun).

One script per launch checks, on every rank:

(a) ``sync_every=1``, an outer SGD with ``outer_lr=1`` and no momentum, and an inner SGD
    without momentum give the synchronous schedule's weights, within float rounding (the
    anchor becomes ``w - (w - mean_r(w - lr * g_r))`` instead of ``w - lr * mean_r(g_r)``);
(b) a one-process reference of the K replicas, written below from the DiLoCo and Streaming
    DiLoCo equations (inner steps alone; every ``H`` steps per fragment, staggered, the
    outer gradient ``anchor - weights`` averaged over the replicas; Nesterov momentum on the
    anchor; with overlap ``tau`` the outer gradient sent ``tau`` steps before the fragment's
    slot and the result applied at the slot, merged as
    ``alpha * weights + (1 - alpha) * anchor``), matches this rank's weights: bit for bit on 2
    ranks (a sum of two has one order), within float rounding on 4;
(c) a run saved mid-cycle, with a fragment's reduction in flight and 4-bit outer gradients
    with error feedback, resumed from each rank's own state dicts and from ``save_checkpoint``
    (each rank's weights and AdamW state in its own part), ends bit for bit where the
    uninterrupted run ends;
(d) a parameter group reducing every step with the synchronous schedule beside the
    local-steps part: the group's weights are identical on every rank after every step,
    the local part's differ between synchronisations and agree right after one;
(e) two local-steps parts (per-group plans: the first layer's outer gradients in 4 bits with
    error feedback, the rest exact), saved mid-cycle with ``save_checkpoint``: each part's
    residuals and inner state come back under its own plan, and the resumed run ends bit for
    bit where the uninterrupted run ends.

Every failure names its rank (the runners report each rank's error).
"""

import pytest

from tests.multirank import run_mpi, run_torch

pytestmark = pytest.mark.distributed

SCRIPT = r"""
import copy, sys
import torch
import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer, load_checkpoint, save_checkpoint

backend, path = sys.argv[1], sys.argv[2]
comm = commopt.create_communicator(backend)
r, n = comm.rank, comm.size
torch.use_deterministic_algorithms(True)


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def loss_of(model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        loss_of(model, step, r).backward()
        opt.step()


def fail(what):
    raise AssertionError(f"rank {r}: {what}")


# (a) sync_every=1 with plain SGD outer and inner: the synchronous schedule's weights.
a, b = net(), net()
opt_a = create_multi_node_optimizer(
    torch.optim.SGD(a.parameters(), lr=0.1), comm, model=a, schedule="local_steps",
    sync_every=1, outer_lr=1.0, outer_momentum=0.0)
opt_b = create_multi_node_optimizer(torch.optim.SGD(b.parameters(), lr=0.1), comm, model=b)
train(a, opt_a, range(8))
train(b, opt_b, range(8))
worst = max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))
if worst > 1e-6:
    fail(f"sync_every=1 differs from the synchronous schedule by {worst}")
print(f"rank {r} sync1 {worst:.3g}")
opt_a.close(); opt_b.close()

# (b) the K-replica reference from the equations.
H, P, TAU, ALPHA, LR, MOM, STEPS = 4, 2, 1, 0.5, 0.7, 0.9, 13


def reference(n, steps):
    replicas = [net() for _ in range(n)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in replicas]
    tensors = [list(m.parameters()) for m in replicas]
    count = len(tensors[0])
    # fragments of near-equal bytes: the first weight (48 elements) alone, its bias and the
    # second layer (8 + 24 + 3) in the other
    frag = [0, 1, 1, 1]
    assert count == 4 and P == 2
    offset = [(f + 1) * H // P % H for f in range(P)]  # staggered: the step of the cycle
    anchor = [t.detach().clone() for t in tensors[0]]
    buf = [None] * count                               # Nesterov momentum of the outer step
    flight = {}                                        # fragment -> (due step, averaged delta)
    for t, step in enumerate(range(steps), start=1):
        for k, (m, o) in enumerate(zip(replicas, inner)):
            o.zero_grad(); loss_of(m, step, k).backward(); o.step()
        for f in range(P):
            if f in flight and flight[f][0] <= t:
                _, delta = flight.pop(f)
                apply(f, delta, frag, anchor, buf, tensors)
        for f in range(P):
            if (t + TAU) % H == offset[f]:             # sent TAU steps before its slot
                delta = {}
                for i in range(count):
                    if frag[i] == f:
                        total = sum(anchor[i] - tensors[k][i].detach() for k in range(n))
                        delta[i] = total / n    # the average of the outer gradients
                if TAU == 0:
                    apply(f, delta, frag, anchor, buf, tensors)
                else:
                    flight[f] = (t + TAU, delta)
    return [[t.detach() for t in ts] for ts in tensors]


def apply(f, delta, frag, anchor, buf, tensors):
    with torch.no_grad():
        for i, d in delta.items():
            # v <- m v + d;  anchor <- anchor - lr (d + m v)
            buf[i] = d.clone() if buf[i] is None else buf[i].mul_(MOM).add_(d)
            anchor[i] = torch.add(anchor[i], torch.add(d, buf[i], alpha=MOM), alpha=-LR)
            for ts in tensors:
                if TAU == 0:
                    ts[i].copy_(anchor[i])
                else:
                    ts[i].copy_(ALPHA * ts[i] + (1 - ALPHA) * anchor[i])


model = net()
opt = create_multi_node_optimizer(
    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm, model=model,
    schedule="local_steps", sync_every=H, fragments=P, overlap_steps=TAU, fragment_alpha=ALPHA,
    outer_lr=LR, outer_momentum=MOM)
train(model, opt, range(STEPS))
expected = reference(n, STEPS)[r]
mine = [p.detach() for p in model.parameters()]
if n == 2:
    if not all(torch.equal(x, y) for x, y in zip(mine, expected)):
        worst = max((x - y).abs().max().item() for x, y in zip(mine, expected))
        fail(f"the schedule differs from the K-replica reference by {worst} (bit for bit expected)")
else:
    worst = max((x - y).abs().max().item() for x, y in zip(mine, expected))
    if worst > 1e-5:
        fail(f"the schedule differs from the K-replica reference by {worst}")
print(f"rank {r} reference ok")
opt.close()

# (c) checkpoint mid-cycle with a fragment in flight, 4-bit outer gradients with error feedback.
def build():
    m = net()
    o = create_multi_node_optimizer(
        torch.optim.AdamW(m.parameters(), lr=0.01), comm, model=m, schedule="local_steps",
        sync_every=4, fragments=2, overlap_steps=1, compression="qsgd4+ef",
        policy=CompressionPolicy(min_compress_numel=8))
    return m, o


m1, o1 = build()
train(m1, o1, range(5))                  # fragment 0 sent after step 5: in flight
if o1.schedule.in_flight != [0]:
    fail(f"expected fragment 0 in flight at the save, got {o1.schedule.in_flight}")
saved = copy.deepcopy({"model": m1.state_dict(), "opt": o1.state_dict()})
save_checkpoint(path, m1, o1)            # each rank's own part: its weights and AdamW state
residuals = saved["opt"]["commopt"]["outer_residuals"]
if not any(s for s in residuals):
    fail("no error-feedback residuals of the outer gradients in the checkpoint")
train(m1, o1, range(5, 15))
m2, o2 = build()
m2.load_state_dict(saved["model"])
o2.load_state_dict(saved["opt"])
train(m2, o2, range(5, 15))
if not all(torch.equal(x, y) for x, y in zip(m1.parameters(), m2.parameters())):
    fail("the resumed run does not end where the uninterrupted run ends")
m3, o3 = build()
load_checkpoint(path, m3, o3)
train(m3, o3, range(5, 15))
if not all(torch.equal(x, y) for x, y in zip(m1.parameters(), m3.parameters())):
    fail("the run resumed from save_checkpoint does not end where the uninterrupted run ends")
print(f"rank {r} resume ok")
o1.close(); o2.close(); o3.close()

# (d) a synchronous group beside the local-steps part.
model = net()
inner = torch.optim.SGD(
    [{"params": list(model[0].parameters()), "schedule": "synchronous"},
     {"params": list(model[2].parameters())}], lr=0.05)
opt = create_multi_node_optimizer(inner, comm, model=model, schedule="local_steps", sync_every=3,
                                  outer_lr=1.0, outer_momentum=0.0)
kinds = sorted(type(s).__name__ for s in opt.plans.values())
if kinds != ["LocalStepsSchedule", "SynchronousSchedule"]:
    fail(f"plans {kinds}")
for step in range(6):
    train(model, opt, [step])
    sync = comm.allgather_obj([p.detach().flatten().tolist() for p in model[0].parameters()])
    local = comm.allgather_obj([p.detach().flatten().tolist() for p in model[2].parameters()])
    if any(theirs != sync[0] for theirs in sync):
        fail(f"the synchronous group differs between ranks after step {step}")
    same = all(theirs == local[0] for theirs in local)
    if same != ((step + 1) % 3 == 0):
        fail(f"the local part {'agrees' if same else 'differs'} across ranks after step {step}")
print(f"rank {r} mixed ok")
opt.close()

# (e) two local-steps parts, each with its own residuals and inner state, saved and resumed.
def build_two():
    m = net()
    o = create_multi_node_optimizer(
        torch.optim.AdamW(m.parameters(), lr=0.01), comm, model=m, schedule="local_steps",
        sync_every=3, outer_lr=0.5, plans=[("0.*", {"compression": "qsgd4+ef"})],
        policy=CompressionPolicy(min_compress_numel=8))
    return m, o


m1, o1 = build_two()
if len(o1.plans) != 2:
    fail(f"expected two local-steps parts, got {sorted(o1.plans)}")
train(m1, o1, range(4))
save_checkpoint(path + "-two", m1, o1)
train(m1, o1, range(4, 11))
m2, o2 = build_two()
load_checkpoint(path + "-two", m2, o2)
train(m2, o2, range(4, 11))
if not all(torch.equal(x, y) for x, y in zip(m1.parameters(), m2.parameters())):
    fail("two local-steps parts resumed from save_checkpoint do not end where the run ends")
print(f"rank {r} two parts ok")
o1.close(); o2.close()
"""


def _check(out, n):
    assert len(out) == n
    for r, text in enumerate(out):
        for what in ("sync1", "reference ok", "resume ok", "mixed ok", "two parts ok"):
            assert f"rank {r} {what}" in text, (r, text)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 4])
def test_torch_gloo_local_steps(tmp_path, n):
    _check(run_torch(SCRIPT, n, args=["torch", str(tmp_path / "ckpt")], timeout=200), n)


@pytest.mark.timeout(240)
def test_mpi_local_steps(tmp_path):
    _check(run_mpi(SCRIPT, 2, args=["mpi", str(tmp_path / "ckpt")], timeout=200), 2)
