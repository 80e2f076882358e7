"""How long a link that comes back leaves a job silent: the longest step around an outage.

Two ranks on the emulated cluster (``commopt launch -n 2 --link 1gbit``, one rank per host)
train a 256-square linear layer for 120 steps through ``create_multi_node_optimizer``; before
step 10 rank 1 breaks its host's data link from inside its namespace, as the fault matrix's
rows do: ``blip`` (down 2 s, then up) or ``flap`` (down 1 s, up 1 s, three times). The
communication timeout is set far above any outage (``--comm-timeout``, 120 s) so every run
finishes; each rank reports its longest step and when, after the fault, that step ended. The
longest step is the silence the transport sat through: the outage plus what the network stack
took to resume (TCP backs its retransmission timer off while the link is down).

    python benchmarks/outage_silence.py --runs 8 --out benchmarks/results/outage-silence.json

Figures depend on the machine's load (printed per run): the emulated hosts share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RANK = r"""
import os, subprocess, sys, time, torch, commopt
transport, fault = sys.argv[1], sys.argv[2]
comm = commopt.create_communicator(transport)
dev = os.environ["COMMOPT_DATA_IFNAME"]
down, up = f"ip link set {dev} down", f"ip link set {dev} up"
FAULTS = {
    "blip": f"{down}; sleep 2; {up}",
    "flap": f"for i in 1 2 3; do {down}; sleep 1; {up}; sleep 1; done",
}
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
opt = commopt.create_multi_node_optimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), comm, model=model)
xs = torch.randn(120, 8, 256, generator=torch.Generator().manual_seed(comm.rank))
fault_t, longest, ended = None, 0.0, 0.0
for step in range(120):
    if step == 10:
        fault_t = time.monotonic()
        if comm.rank == 1:
            subprocess.Popen(["sh", "-c", FAULTS[fault]])
    t0 = time.monotonic()
    opt.zero_grad()
    model(xs[step]).square().mean().backward()
    opt.step()
    t1 = time.monotonic()
    if step >= 10 and t1 - t0 > longest:
        longest, ended = t1 - t0, t1 - fault_t
sys.stdout.write(f"rank {comm.rank} longest {longest:.3f} ended {ended:.3f}\n")
sys.stdout.flush()
"""


def one_run(transport: str, fault: str, comm_timeout: float) -> dict:
    from commopt.commands.launch import launch_argv

    launcher = "torch" if transport == "torch" else "mpi"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(RANK)
    env = dict(os.environ, PYTHONPATH=str(ROOT), COMMOPT_COMM_TIMEOUT=str(comm_timeout))
    argv = launch_argv(2, "--link", "1gbit", "--launcher", launcher, "--timeout", "600")
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    r = subprocess.run(
        [*argv, "--", sys.executable, f.name, transport, fault],
        env=env,
        capture_output=True,
        text=True,
        timeout=700,
    )
    os.unlink(f.name)
    ranks = {
        int(m[0]): {"longest_s": float(m[1]), "ended_after_fault_s": float(m[2])}
        for m in re.findall(r"rank (\d) longest ([0-9.]+) ended ([0-9.]+)", r.stdout)
    }
    return {
        "transport": transport,
        "fault": fault,
        "exit": r.returncode,
        "seconds": round(time.monotonic() - t0, 1),
        "load_average_1m": round(load, 2),
        "ranks": ranks,
        "silence_s": max((v["longest_s"] for v in ranks.values()), default=None),
        "stderr_tail": r.stderr[-1500:] if r.returncode else "",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=8, help="runs per fault and transport")
    p.add_argument("--faults", default="blip,flap")
    p.add_argument("--transports", default="mpi")
    p.add_argument("--comm-timeout", type=float, default=120.0)
    p.add_argument("--out", help="write the runs and a summary as JSON")
    a = p.parse_args()
    runs = []
    for i in range(a.runs):
        for transport in a.transports.split(","):
            for fault in a.faults.split(","):
                r = one_run(transport, fault, a.comm_timeout)
                runs.append(r)
                print(
                    f"run {i + 1}: {transport} {fault}: exit {r['exit']}, longest step "
                    f"{r['silence_s']} s, load {r['load_average_1m']}",
                    flush=True,
                )
    summary = {}
    for r in runs:
        key = f"{r['transport']} {r['fault']}"
        if r["silence_s"] is not None:
            summary.setdefault(key, []).append(r["silence_s"])
    summary = {
        k: {"runs": len(v), "max_s": max(v), "median_s": sorted(v)[len(v) // 2]}
        for k, v in summary.items()
    }
    print(json.dumps(summary, indent=1))
    if a.out:
        record = {
            "command": "python " + " ".join(sys.argv),
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cores": os.cpu_count(),
            "summary": summary,
            "runs": runs,
        }
        Path(a.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
