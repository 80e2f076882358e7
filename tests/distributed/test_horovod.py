"""The Horovod communicator and compression adapters on real ranks, under mpirun and horovodrun.

Skipped, with the reason, where horovod.torch does not import (``make horovod`` builds it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
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


#: The launchers' tag before each piece of a rank's output: ``[rank]<stream>:`` (gloo) or
#: ``[job,rank]<stream>:`` (mpirun --tag-output).
_TAG = re.compile(r"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")


def rank_lines(text: str, stream: str = "stdout") -> dict[int, list[str]]:
    """Each rank's lines of ``stream`` in a launcher's tagged output.

    A tag is looked for anywhere in a line, not only at its start: mpirun writes a rank's
    piece of output and the next piece's tag in separate writes, so a piece that did not end
    its line gets the next rank's tag glued on (``...[1,1]<stdout>:horovod ok rank 1/2``).

        >>> rank_lines("[1,0]<stdout>:a[1,1]<stdout>:b\\n[1,1]<stderr>:w\\n[0]<stdout>:c")
        {0: ['a', 'c'], 1: ['b']}
    """
    by_rank: dict[int, list[str]] = {}
    for line in text.splitlines():
        tags = list(_TAG.finditer(line))
        for i, m in enumerate(tags):
            end = tags[i + 1].start() if i + 1 < len(tags) else len(line)
            if m.group(2) == stream:
                by_rank.setdefault(int(m.group(1)), []).append(line[m.end() : end])
    return by_rank


def run_horovodrun(
    script: Path, nprocs: int, *, gloo: bool = False, timeout: float = 150
) -> tuple[list[list[str]], str]:
    """Run ``script`` with horovodrun on this host: (each rank's stdout lines by rank, the
    launcher's whole output)."""
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
    t = time.monotonic()
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
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)}: exit code {proc.returncode} after {time.monotonic() - t:.0f}s"
            f"\n{out[-4000:]}"
        )
    by_rank = rank_lines(out)
    return [by_rank.get(r, []) for r in range(nprocs)], out


def test_contract_under_mpirun():
    out = run_mpi(CONTRACT, 2, args=["horovod"], timeout=150)
    assert [o.strip() for o in out] == [f"contract ok horovod rank {r}/2" for r in range(2)]


# horovodrun --mpi starts the ranks with mpirun; --gloo with Horovod's own launcher.
@pytest.mark.parametrize("gloo", [False, True], ids=["horovodrun-mpi", "horovodrun-gloo"])
def test_codecs_and_adapters_under_horovodrun(gloo):
    out, whole = run_horovodrun(RANK_SCRIPT, 2, gloo=gloo)
    for r, lines in enumerate(out):
        assert any(line.strip() == f"horovod ok rank {r}/2" for line in lines), (
            f"rank {r} did not finish its checks (the job exited with 0); its stdout: "
            f"{lines[-5:]}; the launcher's output:\n{whole[-4000:]}"
        )


LOST_AFTER_DEPARTURE = """
import time, commopt
from commopt.comm import horovod_exit
comm = commopt.create_communicator("horovod")
comm.barrier()
if comm.rank == 1:
    raise SystemExit(0)  # leaves: its exit notice reaches rank 0, then Horovod shuts down
# Rank 0 waits, as HandleWork.wait does, for a result that never comes: what an operation
# queued while the shutdown drains Horovod's queue gets (a race no run can produce on demand).
watch = horovod_exit.DepartureWatch("allreduce")
start = time.monotonic()
while time.monotonic() - start < 60:
    watch.check()
    time.sleep(0.01)
print("unreachable", flush=True)
"""


def test_a_wait_that_gets_no_result_after_a_departure_names_the_rank_that_left():
    """The departure watch on real ranks (rank 1 really leaves; rank 0's wait is the loop)."""
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_mpi(LOST_AFTER_DEPARTURE, 2, timeout=120)
    msg, took = str(failed.value), time.monotonic() - start
    assert "timed out" not in msg and "unreachable" not in msg, msg
    named = "rank 0: a Horovod operation failed because another rank left the job (rank 1 "
    assert f"PeerLeftError: {named}ended without an error" in msg, msg
    assert "Horovod's allreduce got no result within 5s of the notice" in msg, msg
    assert took < 50, f"rank 0 should end a grace (5 s) after the notice, took {took:.0f}s"


AFTER_A_DEPARTURE = """
import sys, time, torch, commopt
comm = commopt.create_communicator("horovod")
t = torch.ones(16)
comm.allreduce(t)
if comm.rank == 1:
    sys.exit(0)  # leaves: its notice reaches rank 0 at once
time.sleep(3)  # computes, in no Horovod operation, while rank 1 leaves
comm.allreduce(t)
print("unreachable", flush=True)
"""


def test_no_operation_starts_after_a_departure_and_horovod_is_not_shut_down_under_it():
    """Rank 0 starts its next operation 3 s after rank 1 left: it starts none (it raises,
    naming rank 1), and Horovod was not shut down while rank 0 could still start one (rank 1
    waits for rank 0 to stop first): an operation started while Horovod's shutdown frees its
    queue gets no result, or freezes the rank (the GIL against Horovod's process-set lock)."""
    with pytest.raises(AssertionError) as failed:
        run_mpi(AFTER_A_DEPARTURE, 2, timeout=120)
    msg = str(failed.value)
    assert "timed out" not in msg and "unreachable" not in msg, msg
    named = "rank 0: a Horovod operation failed because another rank left the job (rank 1 "
    assert f"PeerLeftError: {named}ended without an error" in msg, msg
    assert "[Horovod's allreduce was not started: a peer left the job]" in msg, msg


CLOSED = """
import gc, torch, commopt
comm = commopt.create_communicator("horovod")
for close in (True, False):
    model = torch.nn.Linear(4, 2)
    opt = commopt.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    if close:
        opt.close()
    del opt
    gc.collect()
model = torch.nn.Linear(4, 2)  # its creation releases the dropped one's communicator
commopt.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model)
t = torch.ones(3)
comm.allreduce(t)
comm.barrier()
print("horovod still runs", comm.rank, t.tolist())
"""


def test_closing_or_dropping_an_optimizer_keeps_horovod_running():
    """An optimizer's private communicator (a split over every rank, Horovod's global
    process set) is released without shutting Horovod down: only the top-level
    communicator owns that."""
    out = run_mpi(CLOSED, 2, timeout=150)
    assert [o.strip() for o in out] == [f"horovod still runs {r} [2.0, 2.0, 2.0]" for r in (0, 1)]
