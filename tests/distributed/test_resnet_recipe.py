"""The ResNet-50 recipe's smoke preset on 2 real ranks: runs, checkpoints, resumes exactly,
and refuses a batch that does not split over the ranks."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.multirank import run_mpi, run_torch
from tests.recipe_args import tiny_resnet

pytestmark = pytest.mark.distributed

MAIN = """
import sys
from recipes.resnet50.train import main
sys.exit(main(sys.argv[1:]))
"""
# ResNet-50 itself at a reduced image size and batch: a few steps stay well under a minute.
TINY = tiny_resnet(log_every=1, threads=1)


def _summary(out: list[str]) -> dict:
    return json.loads(out[0].strip().splitlines()[-1])  # rank 0 prints the summary


@pytest.fixture
def fast_dir(tmp_path):
    """Checkpoints of ResNet-50 with double buffering and error feedback are ~0.5 GB a rank:
    write them to memory where the machine has a tmpfs."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 4 << 30:
        path = Path(tempfile.mkdtemp(prefix="commopt-r50-", dir="/dev/shm"))
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path


def test_smoke_two_ranks_qsgd4_ef_double_buffering_resumes_exactly(fast_dir):
    ck, log = fast_dir / "ck", fast_dir / "log.jsonl"
    comm = ["--compression", "qsgd4+ef", "--double-buffering"]
    straight = run_mpi(
        MAIN,
        2,
        timeout=240,
        args=TINY
        + comm
        + [
            "--max-steps",
            "3",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "2",
            "--log-jsonl",
            str(log),
        ],
    )
    first = _summary(straight)
    assert first["world_size"] == 2 and first["steps"] == 3 and first["label"] == "qsgd4+ef+comp"
    assert straight[1].strip() == ""  # only rank 0 reports
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3]
    assert all(r["images_per_s"] > 0 and r["loss"] > 0 for r in records if r["event"] == "train")
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000002", "step-00000003"]
    # From step 2, with the pending double-buffered gradients and error-feedback residuals of
    # each rank restored, step 3 must produce bit-identical weights.
    resumed = run_mpi(
        MAIN,
        2,
        timeout=240,
        args=TINY
        + comm
        + ["--max-steps", "3", "--checkpoint-dir", str(ck), "--resume", "step-00000002"],
    )
    again = _summary(resumed)
    assert again["steps"] == 1 and again["global_step"] == 3
    assert again["digest"] == first["digest"]


def test_smoke_under_torch_distributed_launch():
    out = run_torch(
        MAIN,
        2,
        timeout=240,
        args=TINY + ["--max-steps", "2", "--no-eval", "--allreduce-grad-dtype", "float16"],
    )
    summary = _summary(out)
    assert summary["world_size"] == 2 and summary["steps"] == 2 and summary["label"] == "float16"


def test_batch_not_divisible_by_ranks_is_refused_by_every_rank():
    with pytest.raises(AssertionError) as err:
        run_mpi(MAIN, 2, timeout=120, args=TINY + ["--batch-size", "5", "--max-steps", "1"])
    message = str(err.value)
    assert (
        "--batch-size 5 is the global batch and must be divisible by the number of ranks (2)"
        in message
    )
    assert "use 4 or 6" in message
