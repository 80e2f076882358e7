"""commopt's phases in torch.profiler: one double-buffered qsgd4+ef step, traced on 2 ranks."""

import json

from commopt.profiling import PHASES
from tests.multirank import run_mpi, run_torch

SCRIPT = r"""
import json, os, sys, tempfile, threading
import torch, commopt
from commopt import profiling

comm = commopt.create_communicator(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
opt = commopt.create_multi_node_optimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), comm, model=model,
    compression="qsgd4+ef", double_buffering=True, bucket_cap_mb=0.1)
def step():
    opt.zero_grad()
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
step()  # the first step only sends: the traced one also applies
with profiling.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    step()
    opt.flush()
trace = os.path.join(tempfile.mkdtemp(), "trace.json")
prof.export_chrome_trace(trace)
with open(trace) as f:
    events = json.load(f)["traceEvents"]
names = {}
for e in events:
    if str(e.get("name", "")).startswith("commopt."):
        names.setdefault(e["name"], set()).add(e.get("tid"))
print(json.dumps({"phases": {k: len(v) for k, v in names.items()},
                  "threads": len({t for v in names.values() for t in v})}))
"""


def _check(outputs):
    for rank, out in enumerate(outputs):
        seen = json.loads(out.strip().splitlines()[-1])
        missing = {f"commopt.{p}" for p in PHASES} - set(seen["phases"])
        assert not missing, f"rank {rank}: the trace lacks {sorted(missing)}: {seen}"
        # pack/unpack on the training thread, the plan's phases on the collectives thread
        assert seen["threads"] >= 2, f"rank {rank}: every phase on one thread: {seen}"


def test_every_phase_is_a_named_range_mpi():
    _check(run_mpi(SCRIPT, 2, args=["mpi"], timeout=180))


def test_every_phase_is_a_named_range_gloo():
    _check(run_torch(SCRIPT, 2, args=["torch"], timeout=180))
