"""The low-rank codec on 2 gloo ranks, against torch's own PowerSGD DDP hook.

DDP with ``powerSGD_hook`` averages each step's gradients; the hook is wrapped to record
every rank's local gradients before it runs and the averages after. commopt then reduces
the same local gradients, from the same starting Q and with the same settings (rank,
error feedback, warm start, ``min_compression_rate``), through its reducer and its
``lowrank`` plan, and must give the same averages to float32 rounding, the same bits on
both ranks. How far float32 rounding goes is measured against a float64 run of the same
algorithm: commopt must be at least about as close to it as torch's hook (it is closer:
torch orthogonalises with QR at rank > 2, commopt with two-pass Gram-Schmidt, and warm
start plus error feedback carry each step's rounding into the next). Then the optimizer wrapper trains with ``compression="powersgd2"``, overlap and
double buffering: the ranks stay identical and the codec's state is in the checkpoint; a
step skipped for NaN leaves no trace in the codec's state; and
as DDP's comm hook (``CommoptHookState("powersgd2")``). Under mpirun, the mpi and horovod
communicators give the bits a two-rank reduction computed in one process gives.
"""

import pytest

from tests.multirank import run_mpi, run_torch

pytestmark = pytest.mark.distributed

ORACLE = r"""
import sys
from collections import defaultdict
import numpy as np
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
import commopt
from commopt.codecs import CompressionPolicy, PowerSGD
from commopt.reducer import GradientReducer

RANK = int(sys.argv[1])
comm = commopt.create_communicator("torch")  # the default gloo group
rank = dist.get_rank()
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)        # 8 x 27 as a matrix
        self.fc1 = torch.nn.Linear(8 * 6 * 6, 40)   # 40 x 288
        self.fc2 = torch.nn.Linear(40, 24)          # 24 x 40
        self.out = torch.nn.Linear(24, 3, bias=False)  # 3 x 24: too small, sent exactly

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(h)))))


net = Net()
names = {id(p): n for n, p in net.named_parameters()}
START, STEPS = 2, 6  # DDP needs start_powerSGD_iter >= 2 (it rebuilds buckets at step 1)
state = psgd.PowerSGDState(
    process_group=None, matrix_approximation_rank=RANK, start_powerSGD_iter=START,
    min_compression_rate=1, use_error_feedback=True, warm_start=True,
    orthogonalization_epsilon=0, random_seed=7)
records = {}


def recording_hook(st, bucket):
    step = st.iter
    views = bucket.gradients()
    local = {names[id(p)]: g.detach().clone() for p, g in zip(bucket.parameters(), views)}
    order = [names[id(p)] for p in bucket.parameters()]

    def done(fut):
        avg = {names[id(p)]: g.detach().clone() for p, g in zip(bucket.parameters(), views)}
        records[step] = (order, local, avg)
        return fut.value()

    return psgd.powerSGD_hook(st, bucket).then(done)


ddp = DDP(net, bucket_cap_mb=100)
ddp.register_comm_hook(state, recording_hook)
gen = torch.Generator().manual_seed(10 + rank)
for _ in range(STEPS):
    x = torch.randn(4, 3, 8, 8, generator=gen)
    ddp.zero_grad()
    ddp(x).square().sum().backward()   # the weights stay fixed: only gradients change

# torch's first Q: one draw from its numpy generator seeds randn for each compressed
# matrix, in its bucket's order grouped by shape (the test rebuilds it; commopt starts from it).
order, _, _ = records[START]
params = dict(net.named_parameters())
def as_matrix(name):
    p = params[name]
    return p.shape[0], p.numel() // p.shape[0]
compressed = [n for n in order if params[n].dim() > 1
              and (sum(as_matrix(n)) * min(RANK, *as_matrix(n)) * 1 < params[n].numel())]
by_shape = defaultdict(list)
for n in compressed:
    by_shape[as_matrix(n)].append(n)
first_q = {}
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(np.random.RandomState(7).randint(1_000_000_000))
    for shape, group in by_shape.items():
        for n in group:
            rows, cols = shape
            first_q[n] = torch.randn(1, cols, min(RANK, rows, cols)).reshape(-1)

# commopt: the same local gradients through its reducer (2-D tensors in a low-rank bucket).
plist = list(net.parameters())
plist_names = [names[id(p)] for p in plist]
codec = PowerSGD(RANK, min_compression_rate=1.0, start_iter=START)  # torch's warm-up
reducer = GradientReducer(comm, plist, plist_names, codec=codec, plain_codec=None,
                          policy=CompressionPolicy(min_compress_numel=0, exclude=()),
                          bucket_cap_mb=100)
(bucket,) = [b for b in reducer.buckets if b.compressed]
by_offset = sorted(bucket.slots, key=lambda s: s.offset)
lay = codec.placement(bucket.numel, [(s.offset, plist[s.param].shape) for s in by_offset])
low = {m.offset for m in lay.matrices}
mine = [plist_names[s.param] for s in by_offset if s.offset in low]
assert sorted(mine) == sorted(compressed), (mine, compressed)
codec.load_state_dict({"qs": {bucket.key: torch.cat([first_q[n] for n in mine])}})

# A float64 run of the same algorithm, from both ranks' local gradients: the yardstick for
# how far float32 rounding alone takes each implementation (torch orthogonalises with QR at
# rank > 2, commopt with Gram-Schmidt; warm start and error feedback carry the rounding on).
def gathered(t):
    out = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(out, t.contiguous())
    return out

ref_q = {n: first_q[n].double().view(as_matrix(n)[1], -1) for n in compressed}
ref_e = {n: [torch.zeros(params[n].shape, dtype=torch.float64)] * 2 for n in compressed}


def reference(step):
    _, local, _ = records[step]
    out = {}
    for n in plist_names:
        both = [g.double() for g in gathered(local[n])]
        if n not in compressed or step < START:  # (warm-up: plain averages)
            out[n] = (both[0] + both[1]) / 2
            continue
        ms = [(g + e).reshape(params[n].shape[0], -1) for g, e in zip(both, ref_e[n])]
        q = torch.linalg.qr(ref_q[n])[0]
        p = torch.linalg.qr(ms[0] @ q + ms[1] @ q)[0]
        ref_q[n] = (ms[0].T @ p + ms[1].T @ p) / 2
        result = p @ ref_q[n].T
        ref_e[n] = [(m - result).reshape(params[n].shape) for m in ms]
        out[n] = result.reshape(params[n].shape)
    return out


worst = 0.0
for step in range(STEPS):  # the warm-up's plain averages, then the compressed steps
    _, local, want = records[step]
    exact = reference(step)
    for p, n in zip(plist, plist_names):
        p.grad = local[n].clone()
    red = reducer.start(step)
    red.issue_remaining()
    red.unpack(zero_fill=True)
    for p, n in zip(plist, plist_names):
        ref = want[n]
        err = ((p.grad - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err)
        assert err < 1e-4, f"rank {rank} step {step} {n}: relative error {err} against powerSGD_hook"
        top = exact[n].abs().max()
        ours = ((p.grad.double() - exact[n]).abs().max() / top).item()
        theirs = ((ref.double() - exact[n]).abs().max() / top).item()
        assert ours <= max(2 * theirs, 2e-6), (
            f"rank {rank} step {step} {n}: {ours:.2e} from the float64 run, torch's hook {theirs:.2e}")
        both = gathered(p.grad)
        assert torch.equal(both[0], both[1]), f"rank {rank} step {step} {n}: ranks differ"
        if step < START:
            assert torch.equal(p.grad, ref), f"rank {rank} warm-up step {step} {n}: not exact"
    if step < START:
        assert not codec.state_dict()["residuals"], f"rank {rank}: warm-up step {step} kept a residual"
print("ok", rank, f"{worst:.2e}")
"""

TRAIN = r"""
import io
import torch, torch.distributed as dist
import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer

comm = commopt.create_communicator("torch")
rank = comm.rank


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 4))
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm,
        double_buffering="stale", compression="powersgd2", model=model, bucket_cap_mb=0.01,
        policy=CompressionPolicy(min_compress_numel=64))
    return model, opt


def train(model, opt, steps):
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


model, opt = build()
losses = train(model, opt, range(4))
buf = io.BytesIO()
torch.save(opt.state_dict(), buf)
codec_state = next(iter(opt.state_dict()["commopt"]["codec_state"].values()))["compressed"]
assert codec_state["qs"] and codec_state["residuals"], f"rank {rank}: no low-rank state saved"
saved_model = {k: v.clone() for k, v in model.state_dict().items()}
losses += train(model, opt, range(4, 8))
opt.flush()
both = [torch.empty_like(flat(model)) for _ in range(2)]
dist.all_gather(both, flat(model))
assert torch.equal(both[0], both[1]), f"rank {rank}: ranks diverged under powersgd2"
assert torch.isfinite(flat(model)).all(), f"rank {rank}: non-finite weights"

model2, opt2 = build()
model2.load_state_dict(saved_model)
buf.seek(0)
opt2.load_state_dict(torch.load(buf, weights_only=False))
train(model2, opt2, range(4, 8))
opt2.flush()
assert torch.equal(flat(model), flat(model2)), f"rank {rank}: restored run differs by {(flat(model) - flat(model2)).abs().max()}"

# NaN on one rank: every rank skips the step, and the codec's Q and residuals go back to what
# they were, so the run is bit for bit the run in which that step never happened.
def run(with_nan):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), comm, compression="powersgd2",
        model=model, policy=CompressionPolicy(min_compress_numel=64))
    for step in (0, 1, "nan", 2, 3) if with_nan else (0, 1, 2, 3):
        g = torch.Generator().manual_seed(100 * (7 if step == "nan" else step) + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        if step == "nan" and rank == 1:
            x[0, 0] = float("nan")
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert opt.skipped_steps == (1 if with_nan else 0), f"rank {rank}: {opt.skipped_steps} skipped"
    return flat(model)


assert torch.equal(run(True), run(False)), f"rank {rank}: a skipped step left a trace"

# The same codec inside DDP, as its comm hook (one reducer per DDP bucket).
from torch.nn.parallel import DistributedDataParallel as DDP
from commopt.integrations.ddp import CommoptHookState, commopt_hook

net, _ = build()
ddp = DDP(net, bucket_cap_mb=0.01)
state = CommoptHookState("powersgd2", model=net, policy=CompressionPolicy(min_compress_numel=64))
ddp.register_comm_hook(state, commopt_hook)
train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), range(6))
both = [torch.empty_like(flat(net)) for _ in range(2)]
dist.all_gather(both, flat(net))
assert torch.equal(both[0], both[1]), f"rank {rank}: ranks diverged in the DDP hook"
saved = state.state_dict()["codecs"]
assert any(c.get("compressed", {}).get("qs") for c in saved.values()), f"rank {rank}: no Q in the hook's state"
print("ok", rank, f"{losses[0]:.3f}->{losses[-1]:.3f}")
"""


@pytest.mark.parametrize("rank", [1, 4])
def test_matches_torch_powersgd_hook(rank):
    out = run_torch(ORACLE, nprocs=2, timeout=300, args=[str(rank)])
    assert [line.split()[:2] for line in out] == [["ok", "0"], ["ok", "1"]], out


def test_optimizer_double_buffering_and_checkpoint():
    out = run_torch(TRAIN, nprocs=2, timeout=300)
    assert [line.split()[:2] for line in out] == [["ok", "0"], ["ok", "1"]], out


TRANSPORT = r"""
import sys
import torch
import commopt
from commopt.codecs import CompressionPolicy, PowerSGD
from commopt.reducer import GradientReducer

comm = commopt.create_communicator(sys.argv[1])
rank, size = comm.rank, comm.size
assert size == 2
shapes = [(24, 16), (16,), (8, 3, 3, 3), (4, 24)]
params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
names = [f"p{i}" for i in range(len(shapes))]
policy = CompressionPolicy(min_compress_numel=0, exclude=())
reducer = GradientReducer(comm, params, names, codec=PowerSGD(2), policy=policy)
(bucket,) = [b for b in reducer.buckets if b.compressed]
where = [(s.offset, shapes[s.param]) for s in bucket.slots]
sims = [PowerSGD(2) for _ in range(size)]  # every rank's codec, here, summing by hand


def grads(step, r):
    g = torch.Generator().manual_seed(1000 * step + r)
    return [torch.randn(s, generator=g) for s in shapes]


for step in range(3):
    for p, g in zip(params, grads(step, rank)):
        p.grad = g.clone()
    red = reducer.start(step)
    red.issue_remaining()
    red.unpack(zero_fill=True)
    flats = []
    for r in range(size):
        flat = torch.zeros(bucket.numel)
        for s, g in zip(bucket.slots, [grads(step, r)[s.param] for s in bucket.slots]):
            flat[s.offset : s.offset + s.numel] = g.reshape(-1)
        flats.append(flat)
    jobs = [c.start(f, where, key=bucket.key, factor=1 / size, size=size, reduction=step)
            for c, f in zip(sims, flats)]
    total = jobs[0].p + jobs[1].p  # two ranks: a sum in either order, the same bits
    for j in jobs:
        j.p.copy_(total)
    qs = [j.after_p_sum() for j in jobs]
    q_total = qs[0] + qs[1]
    for q in qs:
        q.copy_(q_total)
    for j in jobs:
        j.after_q_sum()
    for s in bucket.slots:
        got = params[s.param].grad.reshape(-1)
        want = flats[0][s.offset : s.offset + s.numel]
        assert torch.equal(got, want), (
            f"rank {rank} step {step} {names[s.param]}: {(got - want).abs().max()} from the "
            "reduction computed in one process")
print("ok", rank)
"""


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
def test_host_ordered_transports(backend):
    if backend == "horovod":
        pytest.importorskip("horovod.torch", reason="run 'make horovod' to build it")
    out = run_mpi(TRANSPORT, 2, args=[backend], timeout=240)
    assert [line.split()[:2] for line in out] == [["ok", "0"], ["ok", "1"]], out


WARMUP = r"""
import io
import torch, torch.distributed as dist
import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer

comm = commopt.create_communicator("torch")
rank = comm.rank
START = 3


def build(compression, double_buffering):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm,
        double_buffering=double_buffering, compression=compression, model=model,
        policy=CompressionPolicy(min_compress_numel=64))
    return model, opt


def train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def low_rank_state(opt):
    return next(iter(opt.state_dict()["commopt"]["codec_state"].values()))["compressed"]


for db in (False, "stale"):
    mode = f"double_buffering={db}"
    model, opt = build(f"powersgd2-start{START}", db)
    exact, exact_opt = build(None, db)
    train(model, opt, range(2))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # mid-warm-up
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, range(2, START))
    train(exact, exact_opt, range(START))
    assert torch.equal(flat(model), flat(exact)), f"rank {rank} {mode}: warm-up is not exact"
    assert not low_rank_state(opt)["qs"], f"rank {rank} {mode}: a warm-up step kept a Q"
    train(model, opt, range(START, START + 4))
    train(exact, exact_opt, range(START, START + 4))
    opt.flush(); exact_opt.flush()
    assert not torch.equal(flat(model), flat(exact)), f"rank {rank} {mode}: never compressed"
    assert low_rank_state(opt)["qs"], f"rank {rank} {mode}: no Q after the warm-up"
    both = [torch.empty_like(flat(model)) for _ in range(2)]
    dist.all_gather(both, flat(model))
    assert torch.equal(both[0], both[1]), f"rank {rank} {mode}: ranks diverged"

    resumed, resumed_opt = build(f"powersgd2-start{START}", db)
    resumed.load_state_dict(saved_model)
    buf.seek(0)
    resumed_opt.load_state_dict(torch.load(buf, weights_only=False))
    train(resumed, resumed_opt, range(2, START + 4))
    resumed_opt.flush()
    assert torch.equal(flat(model), flat(resumed)), (
        f"rank {rank} {mode}: the run resumed mid-warm-up differs by "
        f"{(flat(model) - flat(resumed)).abs().max()}")
print("ok", rank)
"""


def test_warm_up_is_exact_and_resumes_mid_warm_up():
    out = run_torch(WARMUP, nprocs=2, timeout=300)
    assert [line.split()[:2] for line in out] == [["ok", "0"], ["ok", "1"]], out
