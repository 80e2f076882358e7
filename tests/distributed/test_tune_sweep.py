"""`commopt tune` for real: a short sweep on loopback through `commopt bench allreduce`."""
from __future__ import annotations

import importlib.util
import shutil

import pytest

BENCH_MISSING = importlib.util.find_spec("commopt.commands.bench") is None


@pytest.mark.distributed
@pytest.mark.skipif(BENCH_MISSING, reason="commopt bench is not part of this build yet")
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found: install Open MPI")
def test_real_sweep_on_loopback(tmp_path):
    from commopt.cli import main

    out = tmp_path / "best.env"
    rc = main(["tune", "-n", "2", "--transport", "mpi", "--grid", "btl_tcp_links=1,2",
               "--bench-args", "--sizes 64K,1M --iters 3 --warmup 1", "--large-from", "64K",
               "--timeout", "120", "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    assert text.startswith("# Written by commopt tune")
    assert "GB/s" in text
