"""create_multi_node_optimizer on real ranks.

Each run batches many checks (a run costs seconds to start): equivalence with
single-process training on the concatenated batch (SGD and Adam, with and without
overlap), the exact stale-by-one double-buffering reference, unused parameters, gradient
accumulation, NaN/Inf skips (with and without GradScaler), compression keeping ranks
identical, re-broadcast on add_param_group, and the errors for mismatched models and
sparse gradients.
"""

import pytest

from tests.multirank import FAKE_NODES, run_mpi, run_torch

pytestmark = pytest.mark.distributed

COMMON = (
    FAKE_NODES
    + r"""
import copy
import commopt
from commopt.optim import create_multi_node_optimizer, ModelMismatchError

comm = commopt.create_communicator(backend)
r, n = comm.rank, comm.size
LOCAL_BATCH = 4


def make_model(seed=0, hidden=16):
    torch.manual_seed(seed + 100 * r)  # different on every rank: the wrapper broadcasts rank 0's
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(LOCAL_BATCH, 6, generator=g), torch.randn(LOCAL_BATCH, 3, generator=g)


def full_batch(step):
    xs, ys = zip(*(batch(step, q) for q in range(n)))
    return torch.cat(xs), torch.cat(ys)


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def rel_err(a, b):
    return max(((p - q).norm() / q.norm()).item() for p, q in zip(a.parameters(), b.parameters()))


def all_same(model, what):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for q, other in enumerate(comm.allgather_obj(flat)):
        assert torch.equal(other, flat), f"{what}: parameters of rank {q} differ from rank {r}"
"""
)

EQUIVALENCE = (
    COMMON
    + r"""
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}
checks = []
# -- fp32: equals single-process training on the concatenated batch ---------------------------
for name, factory in OPTIMIZERS.items():
    for overlap in (True, False):
        model = make_model()
        opt = create_multi_node_optimizer(factory(model.parameters()), comm, overlap=overlap,
                                          model=model, bucket_cap_mb=0.0005)
        assert len(opt.buckets) > 1
        ref = copy.deepcopy(model)  # rank 0's weights, after the broadcast
        ref_opt = factory(ref.parameters())
        for step in range(4):
            opt.zero_grad()
            loss_fn(model, *batch(step, r)).backward()
            opt.step()
            ref_opt.zero_grad()
            loss_fn(ref, *full_batch(step)).backward()
            ref_opt.step()
        err = rel_err(model, ref)
        assert err <= 1e-6, f"{name} overlap={overlap}: relative error {err}"
        all_same(model, f"{name} overlap={overlap}")
        checks.append(f"{name}/overlap={overlap}:{err:.1e}")

# -- double buffering: step t applies step t-1's average; the first step applies nothing -----------
lr = 0.1
model = make_model(seed=1)
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=lr), comm,
                                  double_buffering="stale", model=model, bucket_cap_mb=0.0005)
ref = copy.deepcopy(model)
stale = None
for step in range(4):
    # hand-computed reference: gradients at the current weights, applied one step later
    ref.zero_grad()
    per_rank = []
    for q in range(n):
        ref.zero_grad()
        loss_fn(ref, *batch(step, q)).backward()
        per_rank.append([p.grad.clone() for p in ref.parameters()])
    # the wrapper divides by n before summing (as the transport does)
    avg = [sum((gs[q] * (1.0 / n) for q in range(n)), torch.zeros_like(gs[0])) for gs in zip(*per_rank)]
    with torch.no_grad():
        if stale is not None:
            for p, g in zip(ref.parameters(), stale):
                p.add_(g, alpha=-lr)  # the update torch.optim.SGD makes
    stale = avg
    opt.zero_grad()
    loss_fn(model, *batch(step, r)).backward()
    opt.step()
    err = rel_err(model, ref)
    if n == 2:  # a sum of two is order-free: bit-exact
        assert err == 0.0, f"double buffering step {step}: {err}"
    assert err <= 1e-6, f"double buffering step {step}: {err}"
    if step == 0:
        assert opt.applied_steps == 0, "the first double-buffered step must not update"
assert opt.applied_steps == 3
opt.wait()  # the last step's reduction, still pending, has completed (nothing applied)
assert opt.schedule.pending is not None and opt.schedule.pending.done(), f"rank {r}: wait() left it in flight"
assert opt.applied_steps == 3
opt.flush()
with torch.no_grad():
    for p, g in zip(ref.parameters(), stale):
        p.add_(g, alpha=-lr)
assert opt.applied_steps == 4 and rel_err(model, ref) <= 1e-6, "flush() applies the last gradients"
all_same(model, "double buffering")
checks.append("double-buffering")

# -- zero_grad(set_to_none=False): grads become views of the buckets; same bits as None grads -------
for overlap, db, compression in ((True, False, None), (False, False, None), (True, "stale", None),
                                 (True, "stale", "qsgd4"), (True, False, "qsgd4+ef")):
    finals = []
    for set_to_none in (True, False):
        what_now = f"overlap={overlap} db={db} {compression} set_to_none={set_to_none}"
        model = make_model(seed=2)
        opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          comm, overlap=overlap, double_buffering=db,
                                          compression=compression, model=model, bucket_cap_mb=0.0005)
        for step in range(5):
            opt.zero_grad(set_to_none=set_to_none)
            if not set_to_none and step > 0:
                red = opt.schedule.bucketed.reducer
                params = list(model.parameters())
                for b in red.buckets:
                    for sl in b.slots:
                        g = red.params[sl.param].grad
                        assert g is not None and not g.any(), "zero_grad(False): zeroed grads"
                        slots = [flats[b.index][sl.offset:].data_ptr() for flats in red.buffers]
                        assert g.data_ptr() in slots, f"{what_now}: grad is not a view of its bucket"
            loss_fn(model, *batch(step, r)).backward()
            opt.step()
        if db:
            opt.flush()
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    what = f"views overlap={overlap} db={db} {compression}"
    assert torch.equal(finals[0], finals[1]), f"{what}: set_to_none=False changed the result"
    all_same(model, what)
checks.append("grad-views")

# -- unused parameters: zero_fill=True takes part with zeros; False leaves them out -----------------
class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.only_rank1 = torch.nn.Linear(4, 4)
        self.never = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if r == 1:
            h = h + self.only_rank1(x)
        return h.sum()

for zero_fill in (True, False):
    torch.manual_seed(3)
    m = Branchy()
    opt = create_multi_node_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), comm,
                                      zero_fill=zero_fill, model=m, bucket_cap_mb=0.0001)
    x = torch.ones(2, 4) * (r + 1)
    m(x).backward()
    opt.synchronize()
    assert m.a.weight.grad is not None
    # used on rank 1 only: the average counts rank 0's zeros
    g1 = 2 * 2 * torch.ones(4, 4) / n  # d/dW sum(W x) = sum over batch of x (rank 1: x = 2)
    assert torch.allclose(m.only_rank1.weight.grad, g1), (zero_fill, m.only_rank1.weight.grad)
    if zero_fill:
        assert torch.equal(m.never.weight.grad, torch.zeros(4, 4)), "zero_fill=True: zeros"
    else:
        assert m.never.weight.grad is None and m.never.bias.grad is None, "zero_fill=False: left out"
    opt.step()
    all_same(m, f"unused zero_fill={zero_fill}")
checks.append("unused")

# -- models that differ: an error naming the rank and the parameter, on every rank --------------------------
for wrong in ("shape", "count"):
    torch.manual_seed(0)
    if wrong == "shape":
        m = make_model(hidden=16 if r == 0 else 17)
    else:
        m = make_model()
        if r == n - 1:
            m.append(torch.nn.Linear(3, 3))
    try:
        create_multi_node_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), comm, model=m)
    except ModelMismatchError as e:
        msg = str(e)
        assert f"rank {1 if wrong == 'shape' else n - 1}" in msg, msg
        assert ("0.weight" in msg) if wrong == "shape" else ("parameters" in msg), msg
    else:
        raise AssertionError(f"a {wrong} mismatch must raise")
checks.append("mismatch")

"""
)

# Everything else: 2 ranks (mpi and gloo) only, to keep the suite short.
EXTRAS = r"""
# -- gradient accumulation with no_sync equals the big batch ------------------------------------------
model = make_model(seed=4)
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
ref = copy.deepcopy(model)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
x, y = batch(0, r)
with opt.no_sync():
    (loss_fn(model, x[:2], y[:2]) / 2).backward()
(loss_fn(model, x[2:], y[2:]) / 2).backward()
opt.step()
loss_fn(ref, *full_batch(0)).backward()
ref_opt.step()
assert rel_err(model, ref) <= 1e-6, "no_sync accumulation"
# a second backward without no_sync is refused with a clear error
opt.zero_grad()
loss_fn(model, x, y).backward()
try:
    loss_fn(model, x, y).backward()
except RuntimeError as e:
    assert "no_sync" in str(e), e
else:
    raise AssertionError("second backward after the bucket was sent must raise")
opt.synchronize()
checks.append("no_sync")

# -- NaN on one rank: every rank skips the same step, counted; QSGD too ------------------------------------
for compression in (None, "qsgd4"):
    model = make_model(seed=5)
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                      compression=compression, model=model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    x, y = batch(0, r)
    if r == n - 1:
        x[0, 0] = float("nan")
    loss_fn(model, x, y).backward()
    opt.step()
    assert opt.skipped_steps == 1 and opt.last_step_skipped and opt.applied_steps == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "skipped step changed weights"
    opt.zero_grad()
    loss_fn(model, *batch(1, r)).backward()
    opt.step()
    assert opt.applied_steps == 1 and not opt.last_step_skipped
    all_same(model, f"after skip {compression}")
checks.append("nonfinite")

# -- GradScaler: consistent skip and scale on every rank; training matches the unscaled run -----------------
model = make_model(seed=6)
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
ref = copy.deepcopy(model)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
for step in range(4):
    opt.zero_grad()
    x, y = batch(step, r)
    if step == 1 and r == 0:
        x[0, 0] = float("inf")
    scaler.scale(loss_fn(model, x, y)).backward()
    scaler.step(opt)       # no explicit synchronize: param_groups finishes the reduction
    scaler.update()
    if step != 1:
        ref_opt.zero_grad(); loss_fn(ref, *full_batch(step)).backward(); ref_opt.step()
scales = comm.allgather_obj(scaler.get_scale())
assert len(set(scales)) == 1 and scales[0] == 2.0 ** 9, f"GradScaler scales differ or did not back off: {scales}"
assert rel_err(model, ref) <= 1e-6, "GradScaler + multi-node"
all_same(model, "GradScaler")
# explicit synchronize + unscale_ + clipping on the averaged gradients
opt.zero_grad()
scaler.scale(loss_fn(model, *batch(9, r))).backward()
opt.synchronize()
scaler.unscale_(opt)
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
norms = comm.allgather_obj(float(norm))
assert len(set(norms)) == 1, f"clipping saw different gradients: {norms}"
scaler.step(opt); scaler.update()
all_same(model, "clipping")
checks.append("gradscaler")

# -- double buffering + GradScaler equals double buffering without it -------------------------------------
runs = []
for use_scaler in (False, True):
    model = make_model(seed=7)
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                      double_buffering="stale", model=model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=use_scaler)
    for step in range(4):
        opt.zero_grad()
        scaler.scale(loss_fn(model, *batch(step, r))).backward()
        scaler.step(opt)
        scaler.update()
    opt.flush()
    runs.append(model)
assert rel_err(runs[1], runs[0]) <= 1e-6, "double buffering with GradScaler"
checks.append("db-gradscaler")

# -- compression: ranks stay bit-identical; QSGD training follows fp32 closely ---------------------------
for compression in ("qsgd4", "qsgd4+ef", "fp16", "powersgd2"):
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), comm,
                                      compression=compression, model=model, bucket_cap_mb=0.01)
    assert any(b.compressed for b in opt.buckets) and any(not b.compressed for b in opt.buckets)
    for step in range(3):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step * 10 + r)
        x = torch.randn(4, 64, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
    all_same(model, f"compression {compression}")
checks.append("compression")

# -- add_param_group: the new parameters are broadcast from rank 0 -------------------------------------
model = make_model(seed=9)
opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
extra = torch.nn.Linear(3, 3)  # different weights on every rank
torch.nn.init.constant_(extra.weight, float(r))
opt.add_param_group({"params": extra.parameters()})
assert torch.equal(extra.weight, torch.zeros(3, 3)), "add_param_group must broadcast rank 0's weights"
opt.zero_grad()
extra(model(batch(0, r)[0])).sum().backward()
opt.step()
all_same(extra, "after add_param_group")
checks.append("add_param_group")

# -- sparse gradients: a clear error on every rank (no hang) ------------------------------------------
emb = torch.nn.Embedding(10, 4, sparse=True)
opt = create_multi_node_optimizer(torch.optim.SGD(emb.parameters(), lr=0.1), comm, model=emb)
try:
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
except RuntimeError as e:
    assert "sparse" in str(e) and "sparse=False" in str(e), e
else:
    raise AssertionError("sparse gradients must raise")
opt.remove_hooks()
checks.append("sparse")

"""

DONE = r"""
print(f"optimizer ok {backend} rank {r}/{n} " + " ".join(checks))
"""

HIERARCHICAL = r"""
# 2 fake nodes x 2 ranks: "auto" is hierarchical, so everything above ran through it; here the
# flat algorithm on 4 ranks and compressed hierarchical training.
from commopt import collectives
from commopt.codecs import CompressionPolicy
assert collectives.choose_algorithm(comm, None) == "hierarchical"
model = make_model()
opt = create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), comm,
                                  model=model, bucket_cap_mb=0.0005, algorithm="native")
ref = copy.deepcopy(model)
ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
for step in range(4):
    opt.zero_grad(); loss_fn(model, *batch(step, r)).backward(); opt.step()
    ref_opt.zero_grad(); loss_fn(ref, *full_batch(step)).backward(); ref_opt.step()
assert rel_err(model, ref) <= 1e-6, f"flat native on 4 ranks: {rel_err(model, ref)}"
for compression in ("qsgd4+ef", "bf16", "powersgd2"):
    model = make_model()
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                      compression=compression, model=model,
                                      policy=CompressionPolicy(min_compress_numel=16))
    for step in range(3):
        opt.zero_grad(); loss_fn(model, *batch(step, r)).backward(); opt.step()
    all_same(model, f"hierarchical {compression}")
checks.append("flat+compressed-hierarchical")
"""


def _expect(out, prefix, backend, n):
    assert len(out) == n
    for r, o in enumerate(out):
        assert o.strip().startswith(f"{prefix} ok {backend} rank {r}/{n}"), o


# Open MPI spins while it waits; with more ranks than cores, let the spinning ranks yield.
YIELD = ["--mca", "mpi_yield_when_idle", "1"]


def test_mpi_optimizer_2_ranks():
    out = run_mpi(EQUIVALENCE + EXTRAS + DONE, 2, args=["mpi", "1"], timeout=300, mpirun_args=YIELD)
    _expect(out, "optimizer", "mpi", 2)


def test_mpi_optimizer_4_ranks_as_2x2_nodes():
    """4 ranks on 2 fake nodes: equivalence through the hierarchical algorithm, then flat."""
    out = run_mpi(
        EQUIVALENCE + HIERARCHICAL + DONE, 4, args=["mpi", "2"], timeout=300, mpirun_args=YIELD
    )
    _expect(out, "optimizer", "mpi", 4)


def test_torch_gloo_optimizer():
    out = run_torch(EQUIVALENCE + EXTRAS + DONE, 2, args=["torch", "1"], timeout=300)
    _expect(out, "optimizer", "torch", 2)
