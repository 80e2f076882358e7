"""The Horovod communicator and compression adapters on real ranks, under mpirun and horovodrun.

Skipped, with the reason, where horovod.torch does not import (``make horovod`` builds it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multirank import REPO, _base_env, run_mpi

try:
    import horovod.torch  # noqa: F401

    HOROVOD_MISSING = None
except ImportError as exc:  # pragma: no cover - depends on the machine
    HOROVOD_MISSING = f"horovod.torch does not import ({exc}); run 'make horovod' to build it"

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(HOROVOD_MISSING is not None, reason=HOROVOD_MISSING or ""),
]

HERE = Path(__file__).parent
CONTRACT = (HERE / "comm_contract_rank.py").read_text()
RANK_SCRIPT = HERE / "horovod_rank.py"


def run_horovodrun(
    script: Path, nprocs: int, *, gloo: bool = False, timeout: float = 150
) -> list[str]:
    """Run ``script`` with horovodrun on this host; return each rank's stdout lines, by rank."""
    horovodrun = Path(sys.executable).with_name("horovodrun")
    if not horovodrun.exists():
        pytest.skip(f"horovodrun not found next to {sys.executable}")
    cmd = [
        str(horovodrun),
        "-np",
        str(nprocs),
        "-H",
        f"localhost:{nprocs}",
        *(["--gloo"] if gloo else ["--mpi"]),
        sys.executable,
        str(script),
    ]
    env = _base_env({"PATH": f"{horovodrun.parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)}: timed out after {timeout:.0f}s\n{out[-4000:]}"
        ) from exc
    # horovodrun prefixes each line with [rank] (gloo) or [job,rank] (mpi) and the stream.
    by_rank: dict[int, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"^\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:(.*)$", line)
        if m and m.group(2) == "stdout":
            by_rank.setdefault(int(m.group(1)), []).append(m.group(3))
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: exit code {proc.returncode}\n{out[-4000:]}")
    return [by_rank.get(r, []) for r in range(nprocs)]


def test_contract_under_mpirun():
    out = run_mpi(CONTRACT, 2, args=["horovod"], timeout=150)
    assert [o.strip() for o in out] == [f"contract ok horovod rank {r}/2" for r in range(2)]


# horovodrun --mpi starts the ranks with mpirun; --gloo with Horovod's own launcher.
@pytest.mark.parametrize("gloo", [False, True], ids=["horovodrun-mpi", "horovodrun-gloo"])
def test_codecs_and_adapters_under_horovodrun(gloo):
    out = run_horovodrun(RANK_SCRIPT, 2, gloo=gloo)
    # mpirun's tagging sometimes glues the next line's "[1,1]<stdout>:" onto a line's end:
    # look for each rank's final message, not for the exact last line.
    for r, lines in enumerate(out):
        assert any(f"horovod ok rank {r}/2" in line for line in lines), (
            f"rank {r} did not finish its checks; its output: {lines[-5:]}"
        )
