"""What commopt's exit notices add to a normal end of a Horovod job (Horovod over MPI).

    $ python benchmarks/horovod_exit_cost.py --rounds 3 --out benchmarks/results/horovod-exit-cost.json

Each round starts two 2-rank jobs under mpirun, interleaved: ``horovod`` times
``hvd.shutdown()`` alone (what Horovod does at exit; commopt's hook is switched off),
``commopt`` times commopt's whole exit path (a notice to every peer, ``hvd.shutdown()``,
the exit barrier, reading the peers' notices). Each rank reports its own time in ms after 5
allreduces and a barrier. The floor of both is Horovod's shutdown cycle; commopt adds one
4-byte message per peer and one barrier on loopback (tens of microseconds each).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from commopt.bench import harness

REPO = Path(__file__).resolve().parents[1]
RANK = r"""
import sys, time, torch, commopt
from commopt.comm import horovod_exit
comm = commopt.create_communicator("horovod")
t = torch.ones(1 << 16)
for _ in range(5):
    comm.allreduce(t)
comm.barrier()
t0 = time.perf_counter()
if sys.argv[1] == "commopt":
    horovod_exit._leave()
    horovod_exit._comm = None  # done: nothing more at exit
else:
    horovod_exit._comm = None  # Horovod alone
    comm._hvd.shutdown()
print(f"exit_ms {1e3 * (time.perf_counter() - t0):.3f}", flush=True)
"""


def one_job(mode: str, script: Path) -> tuple[list[float], float]:
    env = {
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "OMPI_MCA_btl": "self,tcp,vader",
        "OMPI_MCA_mpi_yield_when_idle": "1",
    }
    t = time.monotonic()
    out = harness.mpirun(2, [sys.executable, str(script), mode], env=env, timeout=300)
    wall = time.monotonic() - t
    return [float(x) for x in re.findall(r"exit_ms ([\d.]+)", out.stdout)], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows: dict[str, dict[str, list[float]]] = {
        m: {"exit_ms": [], "job_wall_s": []} for m in ("horovod", "commopt")
    }
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK)
        for _ in range(args.rounds):
            for mode in rows:
                ms, wall = one_job(mode, script)
                rows[mode]["exit_ms"] += ms
                rows[mode]["job_wall_s"].append(round(wall, 2))
    result = {
        "command": harness.command_line(__file__),
        "machine": harness.machine(),
        "load_average": [round(load, 1), round(os.getloadavg()[0], 1)],
        "limit": "Horovod's shutdown cycle; commopt adds a 4-byte message per peer and a barrier",
        "modes": {
            m: dict(r, median_exit_ms=round(statistics.median(r["exit_ms"]), 3))
            for m, r in rows.items()
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
