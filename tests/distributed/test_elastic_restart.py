"""Elastic restart: a rank killed at step k, the job restarted, weights bit-identical at the end.

Runs of ``commopt.examples.elastic_train.ElasticRun`` (no codec, fp16, bf16, qsgd4+ef,
qsgd4+ef with double buffering, fp16 with compensated double buffering, a mixed per-group
plan, the low-rank powersgd4, whose warm-start Q and residual are per-rank state: plain,
with double buffering, and with a warm-up that ends after the restart, and local steps with
two fragments and an overlapped reduction, whose weights and inner state are per-rank) train
side by side
on 2 ranks, a checkpoint every 5 steps, the data through a shuffling DistributedSampler over two
epochs. Rank 1 SIGKILLs itself after step 7 of the first attempt; the launcher starts every
rank again (``torchrun --max-restarts 1``, or a second ``mpirun`` as a requeue loop does),
each run resumes from its step-5 checkpoint mid-epoch, and its final weights must equal, bit
for bit, those of the same runs trained from scratch without interruption in the same job
(same transport: fp16 sums may round differently under MPI and gloo).
"""

import subprocess

import pytest
import torch

from tests.multirank import PYTHON, REPO, launcher_free_env, run_mpi

pytestmark = pytest.mark.distributed

RANK_SCRIPT = r"""
import os, signal, sys
from pathlib import Path
import torch
import commopt
from commopt.examples.elastic_train import ElasticRun

comm_name, work, configs = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
CONFIGS = {
    "none": (None, False),
    "fp16": ("fp16", False),
    "bf16": ("bf16", False),
    "qsgd4+ef": ("qsgd4+ef", False),
    "qsgd4+ef+db": ("qsgd4+ef", True),
    "fp16+compensated": ("fp16", "compensated"),
    # low-rank: each rank's warm-start Q and error-feedback residual must resume exactly
    "powersgd4": ("powersgd4", False),
    "powersgd4+db": ("powersgd4", True),
    # warm-up to reduction 6: resumed at 5, the run leaves the warm-up after the restart
    "powersgd4-start6": ("powersgd4-start6", False),
    # a mixed plan: the first layer synchronous, the rest compensated qsgd4+ef
    "mixed": ("qsgd4+ef", "compensated", [("0.*", {"double_buffering": False})]),
    # local steps: 2 fragments, H=4, one step of overlap; killed mid-cycle with a fragment's
    # reduction in flight at the step-5 checkpoint
    "local_steps": ("qsgd4+ef", False, None,
                    {"schedule": "local_steps", "sync_every": 4, "fragments": 2,
                     "overlap_steps": 1}),
}
KILL_AFTER = 7
comm = commopt.create_communicator(comm_name)


def start(root):
    return {
        name: ElasticRun(comm, root / name, steps=12, every=5, compression=CONFIGS[name][0],
                         double_buffering=CONFIGS[name][1],
                         plans=CONFIGS[name][2] if len(CONFIGS[name]) > 2 else None,
                         **(CONFIGS[name][3] if len(CONFIGS[name]) > 3 else {}))
        for name in configs
    }


runs = start(work / "runs")
starts = sorted({run.step for run in runs.values()})
marker = work / "killed"
for steps in zip(*runs.values()):  # one step of every run at a time
    if steps[0] == KILL_AFTER and comm.rank == 1 and not marker.exists():
        marker.write_text("rank 1 killed after step 7\n")
        os.kill(os.getpid(), signal.SIGKILL)
# The same runs from scratch, never interrupted, on this transport.
reference = start(work / "reference")
for _ in zip(*reference.values()):
    pass
comm.barrier()
if comm.rank == 0:
    torch.save({name: run.weights() for name, run in runs.items()}, work / "final.pt")
    torch.save({name: run.weights() for name, run in reference.items()}, work / "reference.pt")
print(f"rank {comm.rank} started at steps {starts}")
"""

ALL = (
    "none,fp16,bf16,qsgd4+ef,qsgd4+ef+db,fp16+compensated,mixed,"
    "powersgd4,powersgd4+db,powersgd4-start6,local_steps"
)


def assert_bit_identical(work) -> None:
    final, reference = torch.load(work / "final.pt"), torch.load(work / "reference.pt")
    assert sorted(final) == sorted(reference)
    for name in reference:
        for key, want in reference[name].items():
            got = final[name][key]
            assert torch.equal(got, want), (
                f"{name}: {key} differs after the restart (max |diff| {(got - want).abs().max()})"
            )


def test_torchrun_max_restarts_resumes_bit_identically(tmp_path):
    script = tmp_path / "elastic_rank.py"
    script.write_text(RANK_SCRIPT)
    env = launcher_free_env()
    env.update(
        PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo"
    )
    cmd = [
        PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.5",
        str(script), "torch", str(tmp_path), ALL,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    assert (tmp_path / "killed").exists(), "rank 1 was never killed: nothing was tested"
    assert "started at steps [5]" in proc.stdout, proc.stdout  # resumed, not started over
    assert_bit_identical(tmp_path)


def test_mpirun_requeue_loop_resumes_bit_identically(tmp_path):
    args = ["mpi", str(tmp_path), "qsgd4+ef+db,fp16+compensated,mixed,powersgd4+db,local_steps"]
    with pytest.raises(AssertionError):  # the first attempt: rank 1 is killed after step 7
        run_mpi(RANK_SCRIPT, 2, args=args, timeout=300)
    assert (tmp_path / "killed").exists()
    out = run_mpi(RANK_SCRIPT, 2, args=args, timeout=300)  # the requeued job
    assert [o.strip() for o in out] == [f"rank {r} started at steps [5]" for r in range(2)]
    assert_bit_identical(tmp_path)
