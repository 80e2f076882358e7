"""`commopt launch` without --link, for real: mpirun and torch.distributed ranks on this machine."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
pytestmark = pytest.mark.distributed

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="mpirun not found: install Open MPI")


def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.run([PY, "-m", "commopt", "launch", *args], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout)


TOPOLOGY = """
import commopt, torch
comm = commopt.create_communicator({name!r})
t = torch.ones(4); comm.allreduce(t)
print(comm.rank, comm.size, comm.intra_rank, comm.intra_size, comm.inter_size, int(t[0]))
"""


def _rows(stdout: str) -> list[list[int]]:
    return sorted([int(x) for x in line.split()] for line in stdout.splitlines() if line.strip())


@needs_mpirun
def test_mpi_two_ranks_with_fake_nodes():
    r = launch("-n", "4", "--ranks-per-host", "2", "--", PY, "-c", TOPOLOGY.format(name="mpi"))
    assert r.returncode == 0, r.stderr
    # rank, size, intra_rank, intra_size, inter_size, allreduce result
    assert _rows(r.stdout) == [[0, 4, 0, 2, 2, 4], [1, 4, 1, 2, 2, 4],
                               [2, 4, 0, 2, 2, 4], [3, 4, 1, 2, 2, 4]]


def test_torch_launcher_two_ranks_gloo():
    r = launch("-n", "2", "--launcher", "torch", "--", PY, "-c", TOPOLOGY.format(name="torch"))
    assert r.returncode == 0, r.stderr
    assert _rows(r.stdout) == [[0, 2, 0, 2, 1, 2], [1, 2, 1, 2, 1, 2]]


def test_torch_launcher_failure_ends_the_job_with_its_code():
    r = launch("-n", "2", "--launcher", "torch", "--", "sh", "-c",
               'if [ "$RANK" = 1 ]; then exit 5; fi; sleep 60', timeout=60)
    assert r.returncode == 5
    assert "rank 1 ended with exit code 5" in r.stderr


@needs_mpirun
def test_mpi_exit_code_and_timeout():
    r = launch("-n", "2", "--", "sh", "-c", 'exit $((OMPI_COMM_WORLD_RANK + 3))')
    assert r.returncode in (3, 4), r.stderr
    r = launch("-n", "2", "--timeout", "2", "--", "sleep", "60", timeout=60)
    assert r.returncode == 124 and "--timeout" in r.stderr


@needs_mpirun
def test_inside_mpirun_it_does_not_start_ranks_again():
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = ["mpirun", *root, "-n", "2", "--bind-to", "none", "--mca", "btl_tcp_if_include", "lo",
           "--mca", "oob_tcp_if_include", "lo", "-x", f"PYTHONPATH={REPO}",
           PY, "-m", "commopt", "launch", "-n", "2", "--", "sh", "-c",
           "echo rank $OMPI_COMM_WORLD_RANK"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["rank 0", "rank 1"]
