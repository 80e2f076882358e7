"""`commopt bench allreduce` on 2 real ranks under mpirun (started by `commopt launch`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from commopt.commands.launch import launch_argv

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found: install Open MPI"),
]


def test_two_rank_sweep_over_codecs():
    pytest.importorskip("mpi4py", reason="mpi4py not installed: pip install mpi4py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env["PYTHONPATH"] = str(REPO)
    cmd = [
        *launch_argv(2, "--"),
        sys.executable,
        "-m",
        "commopt",
        "bench",
        "allreduce",
        "--comm",
        "mpi",
        "-b",
        "64K",
        "-e",
        "256K",
        "-f",
        "4",
        "-n",
        "2",
        "-w",
        "1",
        "--codec",
        "fp32,fp16,qsgd4",
        "--json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # rank 0 alone writes, and only the document
    assert doc["world_size"] == 2 and doc["comm"] == "mpi"
    rows = {(row["size"], row["codec"]): row for row in doc["results"]}
    assert set(rows) == {(s, c) for s in (65536, 262144) for c in ("fp32", "fp16", "qsgd4")}
    limits = {"fp32": 1e-6, "fp16": 1e-3, "qsgd4": 0.5}  # two 4-bit roundings of the mean
    for (size, codec), row in rows.items():
        assert row["max_rel_error"] <= limits[codec], row
        seconds = row["time_us"] / 1e6
        assert row["algbw_gbps"] == pytest.approx(row["wire_bytes"] / seconds / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2(n-1)/n = 1 for n=2
        assert row["effective_busbw_gbps"] == pytest.approx(size / seconds / 1e9)
    # Lossy codecs really are lossy, and fp32 really is exact: the check measures something.
    assert rows[(65536, "qsgd4")]["max_rel_error"] > 1e-3
    assert rows[(65536, "fp16")]["max_rel_error"] > 1e-6
