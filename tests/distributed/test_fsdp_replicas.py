"""FSDP2 with commopt's reduction across nodes, on 4 gloo ranks (2 fake nodes x 2 shards).

The oracle is FSDP2's own HSDP (a 2-D mesh): with the fp32 codec, the weights after 20 Adam
steps are bit-identical (two replicas sum in one order, and the divide factors are powers of
two), also with FSDP's post-divide path and a bf16 reduce dtype. Compressed codecs keep the
replicas of each shard equal and train close to fp32; a NaN on one rank skips the step on
every rank exactly as if it had not happened; a checkpoint restores a killed job bit for bit,
and another layout restarts the residuals, said in the log.
"""

import os
import re
import signal
import subprocess

import pytest

from tests.multirank import PYTHON, REPO, launcher_free_env, run_torch

pytestmark = pytest.mark.distributed

PRELUDE = r"""
import copy, io, os, sys, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, set_model_state_dict, get_optimizer_state_dict,
    set_optimizer_state_dict)
import commopt
from commopt.codecs import CompressionPolicy
from commopt.integrations.fsdp import compress_replicas

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
NODES = int(os.environ.get("NODES", "2"))
mesh = init_device_mesh("cpu", (NODES, world // NODES), mesh_dim_names=("replicate", "shard"))
POLICY = CompressionPolicy(min_compress_numel=256)

def net():
    torch.manual_seed(0)
    # two units of their own; the root keeps the norm and the head (reduced in FSDP's final
    # callback); 301 rows do not split evenly over 2 shards (padding)
    return torch.nn.Sequential(torch.nn.Linear(16, 301), torch.nn.ReLU(), torch.nn.Linear(301, 40),
                               torch.nn.LayerNorm(40), torch.nn.Linear(40, 5))

def shard(model, hsdp=False, **kw):
    m = mesh if hsdp else mesh["shard"]
    fully_shard(model[0], mesh=m, **kw)
    fully_shard(model[2], mesh=m, **kw)
    fully_shard(model, mesh=m, **kw)
    return model

def batch(step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 16, generator=g), torch.randn(16, 5, generator=g)

def train(model, steps, replicas=None, nan_at=None, skip_at=None, opt=None):
    opt = opt or torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in steps:
        x, y = batch(step)
        if step == skip_at:
            continue
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == nan_at and rank == world - 1:
            loss = loss * float("nan")
        loss.backward()
        if replicas is None:
            opt.step()
        else:
            replicas.step(opt)
        losses.append(loss.item())
    return losses, opt

def local(model):
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])

def replicas_equal(model):
    mine = local(model)
    peers = [torch.empty_like(mine) for _ in range(NODES)]
    dist.all_gather(peers, mine, group=mesh["replicate"].get_group())
    return all(torch.equal(p, peers[0]) for p in peers)
"""

ORACLE = (
    PRELUDE
    + r"""
def compare(name, ref, mine, replicas, modes):
    same = torch.equal(local(ref), local(mine))
    diff = (local(ref) - local(mine)).abs().max().item()
    assert same, f"rank {rank} {name}: differs from FSDP2's HSDP by up to {diff}"
    got = [u.mode for u in replicas.units]
    assert got == modes, f"rank {rank} {name}: modes {got}, expected {modes}"

# fp32: FSDP divides inside the node (AVG), the hook averages the 2 replicas after backward
ref = shard(net(), hsdp=True); train(ref, range(20))
mine = shard(net()); reps = compress_replicas(mine, mesh["replicate"], "fp32", policy=POLICY)
train(mine, range(20), reps)
compare("fp32", ref, mine, reps, ["deferred"] * 3)
assert reps.step_number == 20 and reps.applied_steps == 20 and reps.skipped_steps == 0

# two backwards per step: the second one's gradients are added by FSDP onto the first's
# (the hook waits for them), as native HSDP adds its two all-reduced ones
def accumulate(model, replicas=None):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(8):
        opt.zero_grad()
        for micro in (2 * step, 2 * step + 1):
            x, y = batch(micro)
            torch.nn.functional.mse_loss(model(x), y).backward()
        (replicas.step(opt) if replicas is not None else opt.step())

ref = shard(net(), hsdp=True); accumulate(ref)
mine = shard(net()); reps = compress_replicas(mine, mesh["replicate"], "fp32", policy=POLICY)
accumulate(mine, reps)
compare("fp32 two backwards per step", ref, mine, reps, ["deferred"] * 3)
assert reps.step_number == 16, reps.step_number

# sums only, FSDP divides after the hook: the hook waits (post-divide seen by the probe)
ref = shard(net(), hsdp=True); ref.set_force_sum_reduction_for_comms(True)
for m in ref.modules():
    if hasattr(m, "set_force_sum_reduction_for_comms"): m.set_force_sum_reduction_for_comms(True)
train(ref, range(20))
mine = shard(net())
for m in mine.modules():
    if hasattr(m, "set_force_sum_reduction_for_comms"): m.set_force_sum_reduction_for_comms(True)
reps = compress_replicas(mine, mesh["replicate"], "fp32", policy=POLICY)
train(mine, range(20), reps)
compare("fp32 force-sum", ref, mine, reps, ["blocking"] * 3)

# a custom divide factor (the sum over all 4 ranks divided by 8), given to compress_replicas
ref = shard(net(), hsdp=True)
for m in ref.modules():
    if hasattr(m, "set_gradient_divide_factor"):
        m.set_force_sum_reduction_for_comms(True); m.set_gradient_divide_factor(8.0)
train(ref, range(20))
mine = shard(net())
for m in mine.modules():
    if hasattr(m, "set_force_sum_reduction_for_comms"): m.set_force_sum_reduction_for_comms(True)
reps = compress_replicas(mine, mesh["replicate"], "fp32", policy=POLICY, gradient_divide_factor=8.0)
train(mine, range(20), reps)
compare("fp32 divide factor 8", ref, mine, reps, ["blocking"] * 3)

# bf16 reduce dtype: FSDP casts the hook's tensor to fp32 afterwards (the hook waits)
mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
ref = shard(net(), hsdp=True, mp_policy=mp); train(ref, range(20))
mine = shard(net(), mp_policy=mp)
reps = compress_replicas(mine, mesh["replicate"], "fp32", policy=POLICY)
train(mine, range(20), reps)
compare("bf16 reduce dtype", ref, mine, reps, ["blocking"] * 3)

# compressed codecs: every shard's replicas stay equal, the loss close to fp32's
fp32_losses, _ = train(shard(net(), hsdp=True), range(20))
# (bf16 and qsgd8 take the same paths); the bound: the last 5 losses' sum against fp32's
for codec, bound in (("fp16", 0.01), ("qsgd4+ef", 0.05), ("qsgd2+ef", 0.15)):
    mine = shard(net())
    reps = compress_replicas(mine, mesh["replicate"], codec, policy=POLICY)
    losses, _ = train(mine, range(20), reps)
    assert replicas_equal(mine), f"rank {rank} {codec}: the replicas of a shard differ"
    gap = abs(sum(losses[-5:]) - sum(fp32_losses[-5:])) / sum(fp32_losses[-5:])
    assert gap < bound, f"rank {rank} {codec}: last losses {losses[-5:]} vs fp32 {fp32_losses[-5:]}"

# NaN on one rank at step 4: every rank skips it, bit-identical to leaving the step out
mine = shard(net()); reps = compress_replicas(mine, mesh["replicate"], "qsgd4+ef", policy=POLICY)
train(mine, range(10), reps, nan_at=4)
assert reps.skipped_steps == 1 and reps.applied_steps == 9, (reps.skipped_steps, reps.applied_steps)
other = shard(net()); reps2 = compress_replicas(other, mesh["replicate"], "qsgd4+ef", policy=POLICY)
train(other, range(10), reps2, skip_at=4)
assert torch.equal(local(mine), local(other)), f"rank {rank}: the skipped step left a trace"
assert reps.step_number == reps2.step_number == 9
print("ok", rank)
"""
)


def test_matches_native_hsdp_and_codecs_keep_replicas_equal():
    out = run_torch(ORACLE, 4, timeout=300)
    assert [o.strip().splitlines()[-1] for o in out] == [f"ok {r}" for r in range(4)]


ERRORS = (
    PRELUDE
    + r"""
import pytest
from commopt.optim.fingerprint import SettingsMismatchError

with pytest.raises(ValueError, match="native HSDP"):
    compress_replicas(shard(net(), hsdp=True), mesh["replicate"])
# the shard dimension given as the replicas: its ranks hold different shards
with pytest.raises(SettingsMismatchError, match="shard differs"):
    compress_replicas(shard(net()), mesh["shard"])
node = dist.get_rank(mesh["replicate"].get_group())
with pytest.raises(SettingsMismatchError, match="compression differs"):
    compress_replicas(shard(net()), mesh["replicate"], "qsgd4" if node == 0 else "qsgd8")
with pytest.raises(ValueError, match="low-rank"):
    compress_replicas(shard(net()), mesh["replicate"], "powersgd2")
with pytest.raises(ValueError, match="no parameters sharded"):
    compress_replicas(net(), mesh["replicate"])

# a parameter without a gradient: FSDP reduces fewer elements than the unit holds
class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, 300), torch.nn.Linear(16, 300)

    def forward(self, x):
        return self.a(x)

x, y = batch(0)
model = Branchy(); fully_shard(model, mesh=mesh["shard"])
reps = compress_replicas(model, mesh["replicate"], "fp32")
with pytest.raises(RuntimeError, match="set_reduce_scatter_unused_params"):
    model(x).sum().backward()
model = Branchy(); fully_shard(model, mesh=mesh["shard"])
model.set_reduce_scatter_unused_params(True)  # the fix the error names
reps = compress_replicas(model, mesh["replicate"], "fp32")
model(x).sum().backward()
assert model.b.weight.grad is not None and reps.step_number == 1

# the communication timeout: node 1 never reduces; node 0 raises within it, naming the wait
import time
from commopt.comm.errors import CommError
flag = os.path.join(sys.argv[1], "timed-out")
# The nodes meet first: the 2 s bound is for the silent node, not for one node still finishing
# the cases above (their last collectives stayed inside each node).
dist.barrier()
model = shard(net()); reps = compress_replicas(model, mesh["replicate"], "qsgd4+ef", timeout=2)
if node == 0:
    start = time.monotonic()
    with pytest.raises(CommError, match="made no progress for 2s"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert time.monotonic() - start < 30
    open(flag + str(rank), "w").close()
else:  # stays alive (silent) until node 0 has timed out
    deadline = time.monotonic() + 90
    while not all(os.path.exists(flag + str(r)) for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
print("ok", rank, flush=True)
os._exit(0)  # the collective node 0 abandoned is still queued in gloo
"""
)


def test_wrong_set_ups_fail_with_the_fix_and_a_silent_node_times_out(tmp_path):
    out = run_torch(ERRORS, 4, timeout=180, args=[str(tmp_path)])
    assert [o.strip().splitlines()[-1] for o in out] == [f"ok {r}" for r in range(4)]


RESUME = (
    PRELUDE
    + r"""
phase, workdir = sys.argv[1], sys.argv[2]
ckpt = f"{workdir}/ckpt"

def build():
    model = shard(net())
    reps = compress_replicas(model, mesh["replicate"], "qsgd4+ef", policy=POLICY)
    return model, reps, torch.optim.Adam(model.parameters(), lr=1e-2)

def state(model, opt, reps):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
            "replicas": reps}

if phase == "first":
    model, reps, opt = build()
    train(model, range(6), reps, opt=opt)
    dcp.save(state(model, opt, reps), checkpoint_id=ckpt)
    dist.barrier()
    print("saved", rank, flush=True)
    os.kill(os.getpid(), 9)  # killed after the checkpoint
elif phase == "resume":
    whole, reps, opt = build()  # the uninterrupted run
    train(whole, range(12), reps, opt=opt)
    whole = local(whole)
    model, reps, opt = build()
    import pytest
    with pytest.raises(ValueError, match="load_planner"):  # a fresh job holds no residuals
        dcp.load(state(model, opt, reps), checkpoint_id=ckpt)
    model, reps, opt = build()
    sd = state(model, opt, reps)
    dcp.load(sd, checkpoint_id=ckpt, planner=reps.load_planner())
    set_model_state_dict(model, sd["model"]); set_optimizer_state_dict(model, opt, sd["optim"])
    assert reps.step_number == 6 and any(u.pending_state for u in reps.units)
    train(model, range(6, 12), reps, opt=opt)
    diff = (whole - local(model)).abs().max().item()
    assert torch.equal(whole, local(model)), f"rank {rank}: resumed run differs by {diff}"
elif phase == "resize":  # 2 nodes of 1 rank: another layout
    import logging
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    model, reps, opt = build()
    sd = state(model, opt, reps)
    dcp.load(sd, checkpoint_id=ckpt, planner=reps.load_planner())
    set_model_state_dict(model, sd["model"]); set_optimizer_state_dict(model, opt, sd["optim"])
    assert reps.step_number == 6 and not any(u.pending_state for u in reps.units)
    train(model, range(6, 8), reps, opt=opt)
    assert replicas_equal(model)
print("ok", rank)
"""
)


def test_resume_after_kill_is_bit_identical_and_another_layout_resets(tmp_path):
    work = str(tmp_path)
    with pytest.raises(AssertionError) as killed:
        run_torch(RESUME, 4, timeout=180, args=["first", work])
    assert str(killed.value).count(f"exit code {-signal.SIGKILL}") == 4, killed.value
    assert os.path.isfile(tmp_path / "ckpt" / ".metadata")
    out = run_torch(RESUME, 4, timeout=180, args=["resume", work])
    assert [o.strip().splitlines()[-1] for o in out] == [f"ok {r}" for r in range(4)]
    resized = run_torch(RESUME, 2, timeout=180, args=["resize", work], env={"NODES": "2"})
    for r, o in enumerate(resized):
        assert o.strip().splitlines()[-1] == f"ok {r}", o
        assert "residuals restart at zero" in o and "shards=2" in o and "shards=1" in o, o


def docs_example() -> str:
    """The first ```python block of docs/fsdp.md's "## Example" section."""
    body = (REPO / "docs" / "fsdp.md").read_text().split("\n## Example\n", 1)[1]
    return re.search(r"```python\n(.*?)```", body.split("\n## ", 1)[0], re.S).group(1)


def test_docs_example_trains_checkpoints_and_resumes(tmp_path):
    script = tmp_path / "train_hsdp.py"
    script.write_text(docs_example())
    runs = []
    for steps in ("60", "70"):  # 60 steps (checkpoint after 50), then resumed to 70
        env = launcher_free_env() | {
            "PYTHONPATH": str(REPO), "CKPT": str(tmp_path / "ckpt"), "STEPS": steps,
        }  # fmt: skip
        done = subprocess.run(
            [PYTHON, "-m", "commopt", "launch", "-n", "4", "--ranks-per-host", "2",
             "--launcher", "torch", "--", PYTHON, str(script)],
            env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        runs.append(done.stdout)
    assert "resumed" not in runs[0] and runs[0].count("step 60, loss") == 4, runs[0]
    assert runs[1].count("resumed after step 50") == 4 and runs[1].count("step 70") == 4, runs[1]
