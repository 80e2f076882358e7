"""``compression="auto"`` with local steps a candidate, on 2 real ranks (gloo and mpirun).

Its measured steps are the local-steps cycle's first inner steps (they send nothing). One
script checks, on every rank:

(a) a slow link, where the plan is local steps with exact outer gradients: the run is bit for
    bit the local-steps schedule's from the first step (the plan took the cycle up: the same
    anchor, the same position, the fragments' synchronisations at the same steps);
(b) a fast link, where the plan reduces every step: right after the measured steps every rank
    holds the mean of the ranks' weights and rank 0's momentum, and from then on the run is
    synchronous SGD from there (a one-process reference of the replicas, written from those
    two rules), within float rounding, the same on every rank;
(c) the measurement resumed from a checkpoint, its cycle due to send during the measured
    steps: nothing is sent, the clock waits, the plan takes the cycle up there (no average:
    the ranks' weights still their own), and after ``final_sync()`` every rank holds the same;
(d) a slow link where 4-bit outer gradients cost no steps: the plan is
    ``compression="qsgd4+ef"`` on local steps, one part, and the run is that configuration's
    bit for bit (the same communicator and the same stochastic rounding);
(e) an overlap so long that the cycle sends after its first step: the measured steps send
    nothing and the clock waits for the plan.

Every failure names its rank.
"""

import pytest

from tests.multirank import run_mpi, run_torch

pytestmark = pytest.mark.distributed

SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
import commopt
from commopt.optim import create_multi_node_optimizer, step_multipliers

backend, tmp = sys.argv[1], Path(sys.argv[2])
comm = commopt.create_communicator(backend)
r, n = comm.rank, comm.size
torch.use_deterministic_algorithms(True)

# Every codec at 10x the steps, local steps at H=16 at 1.1x: on a slow link the plan is local
# steps with exact outer gradients; on a fast one, exact every step.
data = json.loads(step_multipliers.TABLE_PATH.read_text())
for section in ("codecs", "outer_codecs"):
    for entry in data[section].values():
        entry["multiplier"] = 10.0
data["schedules"]["local_steps:16"]["multiplier"] = 1.1
table = tmp / f"table{r}.json"
table.write_text(json.dumps(data))
step_multipliers.TABLE_PATH = table

H, P, TAU, MEASURED, STEPS = 16, 2, 1, 4, 40
LOCAL = dict(sync_every=H, fragments=P, overlap_steps=TAU, outer_lr=0.5)


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def loss_of(model, step, rank):
    x, y = batch(step, rank)
    return torch.nn.functional.mse_loss(model(x), y)


def train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        loss_of(model, step, r).backward()
        opt.step()


def fail(what):
    raise AssertionError(f"rank {r}: {what}")


def agree(model):  # whether every rank holds the same weights (a collective call)
    everyone = comm.allgather_obj([p.detach().flatten().tolist() for p in model.parameters()])
    return all(theirs == everyone[0] for theirs in everyone)


def inner(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


# (a) slow link: local steps with exact outer gradients, bit for bit the schedule's run.
ref, auto = net(), net()
opt_ref = create_multi_node_optimizer(inner(ref), comm, model=ref, schedule="local_steps", **LOCAL)
opt_auto = create_multi_node_optimizer(
    inner(auto), comm, model=auto, compression="auto", auto_link_rate="100kbit", **LOCAL)
train(ref, opt_ref, range(STEPS))
train(auto, opt_auto, range(MEASURED))
if opt_auto.auto_plan is None:
    fail(f"no plan after {MEASURED} steps")
if opt_auto.auto_plan.schedule != "local_steps" or set(opt_auto.auto_plan.choices.values()) != {"none"}:
    fail(f"expected local steps with exact outer gradients, got {opt_auto.auto_plan}")
train(auto, opt_auto, range(MEASURED, STEPS))
if not all(torch.equal(x, y) for x, y in zip(ref.parameters(), auto.parameters())):
    worst = max((x - y).abs().max().item() for x, y in zip(ref.parameters(), auto.parameters()))
    fail(f"auto's local steps differ from the schedule's by {worst} (bit for bit expected)")
print(f"rank {r} continued ok")
opt_ref.close(); opt_auto.close()

# (b) fast link: exact every step after the measured steps, from the replicas' mean.
model = net()
opt = create_multi_node_optimizer(
    inner(model), comm, model=model, compression="auto", auto_link_rate="100gbit", **LOCAL)
train(model, opt, range(MEASURED))
if opt.auto_plan is None or opt.auto_plan.schedule is not None:
    fail(f"expected a per-step plan, got {opt.auto_plan}")
if not agree(model):
    fail("the ranks' weights differ right after the measured steps")
train(model, opt, range(MEASURED, STEPS))

replicas = [net() for _ in range(n)]
opts = [inner(m) for m in replicas]
for step in range(MEASURED):  # each replica alone
    for k, (m, o) in enumerate(zip(replicas, opts)):
        o.zero_grad(); loss_of(m, step, k).backward(); o.step()
with torch.no_grad():
    mean = [sum(ps) / n for ps in zip(*(m.parameters() for m in replicas))]
one, one_opt = replicas[0], opts[0]  # rank 0's momentum
with torch.no_grad():
    for p, m in zip(one.parameters(), mean):
        p.copy_(m)
for step in range(MEASURED, STEPS):  # synchronous: the mean of the ranks' gradients
    grads = []
    for k in range(n):
        one.zero_grad(); loss_of(one, step, k).backward()
        grads.append([p.grad.clone() for p in one.parameters()])
    for p, gs in zip(one.parameters(), zip(*grads)):
        p.grad = sum(gs) / n
    one_opt.step()
worst = max((x - y).abs().max().item() for x, y in zip(one.parameters(), model.parameters()))
if worst > 1e-5:
    fail(f"the per-step plan's run differs from the reference by {worst}")
print(f"rank {r} averaged ok")
opt.close()

# (c) measuring resumed from a checkpoint, so that the cycle would send fragment 0 (at step 7)
# during the measured steps: nothing is sent while measuring, the cycle's clock waits at 6,
# and the plan takes the cycle up there (no average: each rank keeps its own weights).
import copy
m1 = net()
o1 = create_multi_node_optimizer(
    inner(m1), comm, model=m1, compression="auto", auto_link_rate="100kbit", **LOCAL)
train(m1, o1, range(3))
saved = copy.deepcopy({"model": m1.state_dict(), "opt": o1.state_dict()})
o1.close()
m2 = net()
o2 = create_multi_node_optimizer(
    inner(m2), comm, model=m2, compression="auto", auto_link_rate="100kbit", **LOCAL)
m2.load_state_dict(saved["model"])
o2.load_state_dict(saved["opt"])
train(m2, o2, range(3, 3 + MEASURED))   # position 7 would send fragment 0
if o2.auto_plan is None or o2.auto_plan.schedule != "local_steps":
    fail(f"expected local steps after the resumed measurement, got {o2.auto_plan}")
if agree(m2):
    fail("the ranks' weights were averaged after a resumed measurement's plan")
train(m2, o2, range(3 + MEASURED, 4 + MEASURED))  # the plan's first step: 7, fragment 0 sends
(cycle,) = o2.plans.values()
if cycle.position != 7 or cycle.in_flight != [0]:
    fail(f"the cycle should go on from 6: at {cycle.position}, in flight {cycle.in_flight}")
train(m2, o2, range(4 + MEASURED, STEPS))
o2.final_sync()
if not agree(m2):
    fail("the ranks' weights differ after final_sync")
print(f"rank {r} resumed ok")
o2.close()

# (d) slow link, 4-bit outer gradients as cheap as exact ones: the plan is the wrapper's own
# compression="qsgd4+ef" on local steps, and so is the run, bit for bit from the first step
# (the same communicator and the same stochastic rounding as that configuration's).
data["outer_codecs"]["qsgd4+ef"]["multiplier"] = 1.0
table.write_text(json.dumps(data))
from commopt.codecs import CompressionPolicy
SMALL = CompressionPolicy(min_compress_numel=16)  # the 6x8 and 8x3 weights compressed
ref, auto = net(), net()
opt_ref = create_multi_node_optimizer(
    inner(ref), comm, model=ref, compression="qsgd4+ef", schedule="local_steps", policy=SMALL,
    **LOCAL)
opt_auto = create_multi_node_optimizer(
    inner(auto), comm, model=auto, compression="auto", auto_link_rate="100kbit", policy=SMALL,
    **LOCAL)
train(ref, opt_ref, range(STEPS))
train(auto, opt_auto, range(STEPS))
if list(opt_auto.plans) != list(opt_ref.plans):
    fail(f"auto's plans {list(opt_auto.plans)} are not {list(opt_ref.plans)}")
if not all(torch.equal(x, y) for x, y in zip(ref.parameters(), auto.parameters())):
    worst = max((x - y).abs().max().item() for x, y in zip(ref.parameters(), auto.parameters()))
    fail(f"auto's compressed local steps differ from the configuration's by {worst}")
print(f"rank {r} compressed ok")
opt_ref.close(); opt_auto.close()

# (e) the longest overlap (H / P - 1 = 7): the schedule sends fragment 0 after its first step;
# measuring, nothing is sent and the clock waits at 0; under the plan the cycle starts there.
LONG = dict(LOCAL, overlap_steps=H // P - 1)
auto = net()
opt_auto = create_multi_node_optimizer(
    inner(auto), comm, model=auto, compression="auto", auto_link_rate="100kbit", policy=SMALL,
    **LONG)
train(auto, opt_auto, range(MEASURED))
if opt_auto.auto_plan is None or opt_auto.auto_plan.schedule != "local_steps":
    fail(f"expected local steps, got {opt_auto.auto_plan}")
if agree(auto):
    fail("the measured steps reduced something (the ranks' weights agree): they send nothing")
train(auto, opt_auto, range(MEASURED, MEASURED + 1))
(cycle,) = opt_auto.plans.values()
if cycle.position != 1 or cycle.in_flight != [0]:
    fail(f"the cycle should start at the plan: at {cycle.position}, in flight {cycle.in_flight}")
train(auto, opt_auto, range(MEASURED + 1, STEPS))
opt_auto.final_sync()
if not agree(auto):
    fail("the ranks' weights differ after final_sync (overlap 7)")
print(f"rank {r} waited ok")
opt_auto.close()
"""


def _check(out, n):
    assert len(out) == n
    for r, text in enumerate(out):
        for what in ("continued ok", "averaged ok", "resumed ok", "compressed ok", "waited ok"):
            assert f"rank {r} {what}" in text, (r, text)


@pytest.mark.timeout(180)
def test_torch_gloo_auto_measured_on_local_steps(tmp_path):
    _check(run_torch(SCRIPT, 2, args=["torch", str(tmp_path)], timeout=140), 2)


@pytest.mark.timeout(180)
def test_mpi_auto_measured_on_local_steps(tmp_path):
    _check(run_mpi(SCRIPT, 2, args=["mpi", str(tmp_path)], timeout=140), 2)
