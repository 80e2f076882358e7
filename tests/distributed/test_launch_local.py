"""`commopt launch` without --link, for real: mpirun and torch.distributed ranks on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from commopt.commands.launch import launch_argv
from commopt.testbed.mpirun import LOOPBACK_MCA
from tests.multirank import launch, launcher_free_env, needs_mpirun

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
pytestmark = pytest.mark.distributed


# One write per line: ranks share stdout, and unbuffered print() writes piece by piece.
GLOO = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")            # from the launcher's env alone
t = torch.ones(4); dist.all_reduce(t)
sys.stdout.write(f"{dist.get_rank()} {dist.get_world_size()} {os.environ['LOCAL_RANK']} "
                 f"{int(t[0])}\\n")
dist.destroy_process_group()  # torch may abort at exit with a live gloo group
"""


@needs_mpirun
def test_mpi_ranks_on_fake_nodes():
    r = launch(
        "-n",
        "4",
        "--ranks-per-host",
        "2",
        "--",
        "sh",
        "-c",
        "echo $OMPI_COMM_WORLD_RANK $OMPI_COMM_WORLD_SIZE $COMMOPT_NODE_NAME",
    )
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["0 4 node0", "1 4 node0", "2 4 node1", "3 4 node1"]


def test_torch_launcher_two_ranks_gloo():
    r = launch("-n", "2", "--launcher", "torch", "--", PY, "-c", GLOO)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["0 2 0 2", "1 2 1 2"]


# A failing rank under `--launcher torch`: tests/distributed/test_fault_matrix.py.


@needs_mpirun
def test_mpi_exit_code_is_the_jobs():
    # (--timeout is covered by tests/unit/test_launch.py, on the same job runner.)
    r = launch("-n", "2", "--", "sh", "-c", "exit $((OMPI_COMM_WORLD_RANK + 3))")
    assert r.returncode in (3, 4), r.stderr


@needs_mpirun
def test_inside_mpirun_it_does_not_start_ranks_again():
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = [
        "mpirun",
        *root,
        "-n",
        "2",
        "--bind-to",
        "none",
        *LOOPBACK_MCA,
        "-x",
        f"PYTHONPATH={REPO}",
        *launch_argv(2, "--"),
        "sh",
        "-c",
        "echo rank $OMPI_COMM_WORLD_RANK",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert sorted(r.stdout.splitlines()) == ["rank 0", "rank 1"]


@needs_mpirun
def test_a_parent_that_ran_mpi_as_a_singleton_can_still_launch():
    # mpi4py's import makes the parent an MPI singleton, whose PMIX_/OMPI_ variables its
    # children inherit: mpirun started with them used to exit 1 without a word.
    parent = (
        "import subprocess, sys\n"
        "from mpi4py import MPI\n"
        "assert MPI.Is_initialized()\n"
        f"sys.exit(subprocess.call({launch_argv(2, '--')!r} + "
        "['sh', '-c', 'echo rank $OMPI_COMM_WORLD_RANK']))\n"
    )
    env = dict(launcher_free_env(), PYTHONPATH=str(REPO))
    r = subprocess.run(
        [PY, "-c", parent], capture_output=True, text=True, timeout=120, cwd=str(REPO), env=env
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert sorted(r.stdout.splitlines()) == ["rank 0", "rank 1"]
