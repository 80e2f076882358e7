"""pure_nccl's bootstrap without MPI: over torch.distributed's store (torchrun's ``env://``
variables) and, in a world of one, over nothing.

The NCCL calls themselves need CUDA (tests/gpu); here each rank runs the real
``NcclCommunicator`` with a :class:`~commopt.comm.stream_trace.StreamTrace` in place of CUDA's
streams and NCCL, so what is checked is the bootstrap: which one ``auto`` picks, the unique id
rank 0 makes reaching every rank, barriers, objects and split over it, and that MPI is never
loaded. mpi4py is made unimportable in these processes (a stand-in package that raises), as on
a machine whose mpi4py finds no MPI library.
"""

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.multirank import PYTHON, REPO, run_torch

# A stand-in mpi4py whose import fails as mpi4py does without an MPI library.
NO_MPI = 'raise ImportError("cannot load MPI library (simulated: no libmpi here)")\n'

SCRIPT = r"""
import json, os, sys
import torch
from commopt.comm.nccl import NcclCommunicator
from commopt.comm.stream_trace import StreamTrace

trace = StreamTrace()
comm = NcclCommunicator(_streams=trace)
t = torch.ones(8)
comm.allreduce(t)                       # the first collective creates the NCCL communicator
comm.barrier()
seen = comm.bcast_obj({"from": comm.rank, "words": [1, 2, 3]}, root=0)
gathered = comm.allgather_obj(comm.rank * 10)
child = comm.split(comm.rank % 2, comm.rank)   # a world of one per rank (2 ranks)
child.allreduce(torch.ones(4))
out = {
    "rank": comm.rank,
    "size": comm.size,
    "bootstrap": comm.bootstrap,
    "child_bootstrap": child.bootstrap,
    "uids": [list(u) for u in trace.unique_ids],
    "seen": seen,
    "gathered": gathered,
    "child_size": child.size,
    "mpi_loaded": "mpi4py.MPI" in sys.modules,
}
comm.finalize()
print("RESULT " + json.dumps(out), flush=True)
"""


def _no_mpi_dir(tmp_path: Path) -> Path:
    pkg = tmp_path / "no_mpi" / "mpi4py"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(NO_MPI)
    return tmp_path / "no_mpi"


def _results(outs: list[str]) -> list[dict]:
    rows = []
    for rank, out in enumerate(outs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, f"rank {rank} printed no result:\n{out}"
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    return rows


def test_torchrun_ranks_exchange_the_unique_id_over_the_store_without_mpi(tmp_path):
    hidden = _no_mpi_dir(tmp_path)
    outs = run_torch(
        SCRIPT, 2, timeout=150, env={"PYTHONPATH": f"{hidden}:{REPO}", "COMMOPT_COMM_TIMEOUT": "60"}
    )
    rows = _results(outs)
    for rank, row in enumerate(rows):
        assert row["rank"] == rank and row["size"] == 2, f"rank {rank}: {row}"
        assert row["bootstrap"] == "store", f"rank {rank} bootstrapped over {row['bootstrap']}"
        assert not row["mpi_loaded"], f"rank {rank} loaded MPI"
        assert row["seen"] == {"from": 0, "words": [1, 2, 3]}, f"rank {rank}: {row['seen']}"
        assert row["gathered"] == [0, 10], f"rank {rank}: {row['gathered']}"
        assert row["child_size"] == 1 and row["child_bootstrap"] == "split", f"rank {rank}"
        # the parent's communicator, then the child's: one unique id each, 128 bytes
        assert len(row["uids"]) == 2 and all(len(u) == 128 for u in row["uids"]), f"rank {rank}"
    assert rows[0]["uids"][0] == rows[1]["uids"][0], "rank 1 did not get rank 0's unique id"


def test_a_world_of_one_needs_no_bootstrap_and_no_mpi(tmp_path):
    hidden = _no_mpi_dir(tmp_path)
    code = SCRIPT.replace("comm.rank % 2", "0")
    proc = subprocess.run(
        [PYTHON, "-c", code],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{hidden}:{REPO}", "HOME": str(tmp_path)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = _results([proc.stdout])
    assert (row["bootstrap"], row["size"], row["mpi_loaded"]) == ("none", 1, False), row
    assert len(row["uids"]) == 2


def test_an_mpi_bootstrap_without_mpi_says_what_to_do(tmp_path):
    hidden = _no_mpi_dir(tmp_path)
    code = textwrap.dedent(
        """
        from commopt.comm.nccl import NcclCommunicator
        from commopt.comm.stream_trace import StreamTrace
        NcclCommunicator(_streams=StreamTrace(), bootstrap="mpi")
        """
    )
    proc = subprocess.run(
        [PYTHON, "-c", code],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{hidden}:{REPO}", "HOME": str(tmp_path)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "torchrun" in proc.stderr and "cannot load MPI" in proc.stderr, proc.stderr[-2000:]


def test_an_unknown_bootstrap_is_refused():
    from commopt.comm.nccl import choose_bootstrap

    with pytest.raises(ValueError, match="choose one of auto, mpi, store, none"):
        choose_bootstrap("tcp")
