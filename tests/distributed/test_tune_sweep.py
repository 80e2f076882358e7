"""`commopt tune` for real: a short sweep on loopback through `commopt bench allreduce`."""

from __future__ import annotations

import importlib.util
import re
import shutil

import pytest

BENCH_MISSING = importlib.util.find_spec("commopt.commands.bench") is None


@pytest.mark.distributed
@pytest.mark.skipif(BENCH_MISSING, reason="commopt bench is not part of this build yet")
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found: install Open MPI")
def test_real_sweep_on_loopback(tmp_path, capsys):
    """Two points (the defaults and 2 TCP links per peer), each a real 2-rank benchmark."""
    from commopt.cli import main

    out = tmp_path / "best.env"
    rc = main(
        [
            "tune",
            "-n",
            "2",
            "--transport",
            "mpi",
            "--grid",
            "btl_tcp_links=2",
            "--bench-args",
            "-b 256K -e 1M -f 4 -n 3 -w 1",
            "--large-from",
            "256K",
            "--timeout",
            "120",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "[1/2] (defaults): " in printed and "[2/2] btl_tcp_links=2: " in printed
    header = re.search(r"^#\s+setting", printed, re.MULTILINE)  # column widths vary
    assert header, printed
    table = printed[header.start() :].splitlines()
    assert "256K GB/s" in table[0] and "1M GB/s" in table[0]
    winner = table[2].split()[1]  # the first ranked row's setting
    text = out.read_text()
    assert text.startswith("# Written by commopt tune") and "GB/s" in text
    if winner == "(defaults)":
        assert "nothing to export" in text
    else:
        assert "export OMPI_MCA_btl_tcp_links=2" in text
