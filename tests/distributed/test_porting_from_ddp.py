"""What a DDP script does, on 2 real ranks: clipping, GradScaler, closure optimizers, DDP models.

Each rank trains on its own batch; the reference is one process on the concatenated
batch (what DDP computes). Checked: ``clip_grad_norm_`` between ``backward()`` and
``step()`` (default overlap), the loud error and Horovod's synchronize()/skip_synchronize()
without overlap, the built-in ``clip_grad_norm=`` with double buffering, GradScaler's
unscale_ + clip, LBFGS with ``step(closure)``, and the refusal of DDP-wrapped models
(torch.distributed ranks only: DDP needs its process group).
"""

import pytest

from tests.multirank import run_mpi, run_torch

pytestmark = pytest.mark.distributed

COMMON = r"""
import copy, sys
import torch
import commopt
from commopt.optim import create_multi_node_optimizer

backend = sys.argv[1]
comm = commopt.create_communicator(backend)
r, n = comm.rank, comm.size
LR, MAX_NORM = 0.1, 1e-2


def make_model():
    torch.manual_seed(r)  # different on every rank: the wrapper broadcasts rank 0's
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), 50 * torch.randn(4, 3, generator=g)


def full_batch(step):
    xs, ys = zip(*(batch(step, q) for q in range(n)))
    return torch.cat(xs), torch.cat(ys)


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check(model, ref, what, tol=1e-5):
    err = ((flat(model) - flat(ref)).norm() / flat(ref).norm()).item()
    assert err <= tol, f"rank {r}: {what}: relative error {err:.2e} against one process on the full batch"
    for q, other in enumerate(comm.allgather_obj(flat(model))):
        assert torch.equal(other, flat(model)), f"{what}: parameters of rank {q} differ from rank {r}"


def clipped_sgd_reference(start, steps, stale=False):
    ref = copy.deepcopy(start)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    pending = None
    for step in list(range(steps)) + ([None] if stale else []):
        if step is not None:
            opt.zero_grad()
            loss_fn(ref, *full_batch(step)).backward()
            grads = [p.grad.clone() for p in ref.parameters()]
            if stale:
                grads, pending = pending, grads
        else:
            grads = pending  # double buffering's flush()
        if grads is None:
            continue
        for p, g in zip(ref.parameters(), grads):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step()
    return ref


"""

CLIPPING = r"""
# 1. clip_grad_norm_ between backward() and step(), default mode: clips the average
model = make_model()
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=LR), comm, model=model)
start = copy.deepcopy(model)
for step in range(3):
    opt.zero_grad()
    loss_fn(model, *batch(step, r)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    norms = comm.allgather_obj(float(norm))
    assert len(set(norms)) == 1, f"rank {r}: clipping saw different gradients on the ranks: {norms}"
    opt.step()
check(model, clipped_sgd_reference(start, 3), "clip between backward and step")

# 1b. overlap=False: the same clip raises (on every rank, before any traffic); Horovod's pattern works
model = make_model()
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=LR), comm, model=model,
                                  overlap=False)
start = copy.deepcopy(model)
loss_fn(model, *batch(0, r)).backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
try:
    opt.step()
    raise AssertionError(f"rank {r}: a clip of local gradients went unnoticed")
except RuntimeError as e:
    assert "skip_synchronize" in str(e) and "clip_grad_norm=" in str(e), e
opt.zero_grad()
for step in range(3):
    opt.zero_grad()
    loss_fn(model, *batch(step, r)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    with opt.skip_synchronize():
        opt.step()
check(model, clipped_sgd_reference(start, 3), "synchronize + clip + skip_synchronize")

# 1c. built-in clip_grad_norm= with double buffering: clips the gradients applied (one step stale)
model = make_model()
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=LR), comm, model=model,
                                  double_buffering="stale", clip_grad_norm=MAX_NORM)
start = copy.deepcopy(model)
for step in range(3):
    opt.zero_grad()
    loss_fn(model, *batch(step, r)).backward()
    opt.step()
opt.flush()
check(model, clipped_sgd_reference(start, 3, stale=True), "clip_grad_norm= with double buffering")

# 1d. GradScaler as in the AMP docs: scale, backward, unscale_, clip, step, update
model = make_model()
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=LR), comm, model=model)
start = copy.deepcopy(model)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
for step in range(3):
    opt.zero_grad()
    scaler.scale(loss_fn(model, *batch(step, r))).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    scaler.step(opt)
    scaler.update()
check(model, clipped_sgd_reference(start, 3), "GradScaler unscale_ + clip")

"""

CLOSURE = r"""
# 2. LBFGS: every closure call's loss and gradients are averaged over the ranks
model = make_model()
opt = create_multi_node_optimizer(
    torch.optim.LBFGS(model.parameters(), max_iter=6, history_size=4, line_search_fn="strong_wolfe"), comm, model=model)
ref = copy.deepcopy(model)
ref_opt = torch.optim.LBFGS(ref.parameters(), max_iter=6, history_size=4, line_search_fn="strong_wolfe")
calls = 0
for step in range(3):
    def closure():
        global calls
        calls += 1
        opt.zero_grad()
        x, y = batch(step, r)
        out = loss_fn(model, x, y / 50)  # well conditioned: LBFGS amplifies rounding otherwise
        out.backward()
        return out

    def ref_closure():
        ref_opt.zero_grad()
        x, y = full_batch(step)
        out = loss_fn(ref, x, y / 50)
        out.backward()
        return out
    got, want = float(opt.step(closure)), float(ref_opt.step(ref_closure).detach())
    assert abs(got - want) <= 1e-5 * abs(want), f"rank {r}: LBFGS loss {got} != {want}"
assert len(set(comm.allgather_obj(calls))) == 1, "the ranks evaluated the closure different times"
check(model, ref, "LBFGS step(closure)", tol=1e-4)

"""

DDP_MODEL = r"""
# 4. a DDP model shown to the optimizer (model=, or a module holding one): refused
from torch.nn.parallel import DistributedDataParallel as DDP
net = make_model()
ddp = DDP(net)
for shown in (ddp, torch.nn.ModuleDict({"wrapped": ddp})):
    try:
        create_multi_node_optimizer(torch.optim.SGD(ddp.parameters(), lr=LR), comm, model=shown)
        raise AssertionError(f"rank {r}: a DDP model was accepted ({type(shown).__name__})")
    except ValueError as e:
        assert "DistributedDataParallel" in str(e) and "ddp_model.module" in str(e), e
        assert "commopt_hook" in str(e), e
"""

END = 'print("ok", r)\n'


@pytest.mark.parametrize("part", ["clipping", "closure", "ddp"])
def test_under_torch_distributed(part):
    code = {"clipping": CLIPPING, "closure": CLOSURE, "ddp": DDP_MODEL}[part]
    out = run_torch(COMMON + code + END, nprocs=2, timeout=120, args=["torch"])
    assert out == ["ok 0\n", "ok 1\n"]


def test_clipping_and_closure_under_mpi():
    out = run_mpi(COMMON + CLIPPING + CLOSURE + END, nprocs=2, timeout=180, args=["mpi"])
    assert out == ["ok 0\n", "ok 1\n"]
