"""Run a Python snippet on several real ranks, with a timeout, and report failures by rank.

    out = run_mpi('''
        import commopt, torch
        comm = commopt.create_communicator("mpi")
        t = torch.full((3,), float(comm.rank)); comm.allreduce(t)
        assert t.tolist() == [1.0] * 3, t
        print("ok", comm.rank)
    ''', nprocs=2)
    assert out == ["ok 0\\n", "ok 1\\n"]

``run_mpi`` starts the ranks with mpirun; ``run_torch`` starts them as plain processes with
torch.distributed's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK) for gloo.
Both return each rank's stdout in rank order, or raise AssertionError naming every rank
that failed with the end of its stderr (the assertion and traceback), or the timeout.

A runner's timeout never reaches the running test's own (pytest-timeout's, recorded for each
test by tests/conftest.py): it ends :data:`RUNNER_MARGIN_S` seconds before it, so a job that
hangs is killed by its runner, which first has every rank print its stacks
(:func:`runner_timeout`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from commopt.testbed.mpirun import LOOPBACK_MCA
from commopt.testbed.torch_dist import free_port

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

#: A rank script's opening for fake nodes: ``args=[backend, per_node]`` name the communicator's
#: back-end and the ranks per node, and the node name is set before commopt reads it.
FAKE_NODES = r"""
import os, sys
import torch
from commopt.comm.launcher import detect_launcher

backend, per_node = sys.argv[1], int(sys.argv[2])
info = detect_launcher()
os.environ["COMMOPT_NODE_NAME"] = f"node-{info.rank // per_node}"
"""


#: Seconds a runner keeps before the running test's per-test timeout: enough to have every rank
#: print its stacks (2 s a job), kill the job and read what the ranks wrote.
RUNNER_MARGIN_S = 20.0
#: When the running test's per-test timeout fires (``time.monotonic()``), or None.
_test_deadline: list[float | None] = [None]


def set_test_timeout(seconds: float | None) -> None:
    """The running test's per-test timeout starts now (None or 0: it has none)."""
    _test_deadline[0] = time.monotonic() + seconds if seconds else None


def runner_timeout(timeout: float) -> float:
    """``timeout``, cut so that it ends :data:`RUNNER_MARGIN_S` before the running test's
    timeout: a hung job is then ended by its runner, with every rank's stacks, not by pytest
    (``tests/unit/test_multirank.py``)."""
    deadline = _test_deadline[0]
    if deadline is None:
        return timeout
    return max(1.0, min(timeout, deadline - time.monotonic() - RUNNER_MARGIN_S))


def mpirun_available() -> bool:
    return shutil.which("mpirun") is not None


def launcher_free_env() -> dict[str, str]:
    """This environment without any launcher's variables (this process may itself run under
    mpirun, torchrun or Slurm), for a child that must start a job of its own."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }


def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``commopt launch ARGS`` from the repository, with no launcher's variables inherited."""
    env = launcher_free_env()
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [PYTHON, "-m", "commopt", "launch", *args],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=runner_timeout(timeout),
    )


needs_mpirun = pytest.mark.skipif(
    not mpirun_available(), reason="mpirun not found: install Open MPI"
)


def _base_env(env: dict | None) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e["PYTHONUNBUFFERED"] = "1"
    e.setdefault("OMP_NUM_THREADS", "1")  # ranks share 2 cores: no thread oversubscription
    e.update({k: str(v) for k, v in (env or {}).items()})
    return e


#: Prepended to every rank script: SIGUSR1 prints every thread's stack (a rank that timed
#: out says where it waited). Not where the script has ``from __future__`` imports (first).
_STACKS_ON_USR1 = (
    "import faulthandler as _fh, signal as _sg; _fh.register(_sg.SIGUSR1, all_threads=True)\n"
)


def _write_script(code: str, workdir: Path) -> Path:
    script = workdir / "rank_script.py"
    body = textwrap.dedent(code)
    script.write_text(body if "from __future__" in body else _STACKS_ON_USR1 + body)
    return script


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when it is gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def _dump_stacks(pgid: int) -> None:
    """Before a timed-out job is killed: each rank of process group ``pgid`` prints its stacks."""
    if _signal_group(pgid, signal.SIGUSR1):
        time.sleep(2.0)


def _report(
    results: list[tuple[int, int | None, str, str]], timeout: float, what: str
) -> list[str]:
    failed = [(r, rc, out, err) for r, rc, out, err in results if rc != 0]
    if failed:
        lines = [f"{what}: {len(failed)} of {len(results)} ranks failed"]
        for r, rc, out, err in failed:
            why = f"timed out after {timeout:.0f}s" if rc is None else f"exit code {rc}"
            tail = "\n".join((err or out).strip().splitlines()[-(25 if rc is not None else 400) :])
            lines.append(f"--- rank {r}: {why}\n{tail}")
        raise AssertionError("\n".join(lines))
    return [out for _, _, out, _ in results]


def run_mpi(
    code: str,
    nprocs: int,
    *,
    timeout: float = 120,
    env: dict | None = None,
    args: list[str] | tuple = (),
    mpirun_args: list[str] | tuple = (),
) -> list[str]:
    """Run ``code`` under ``mpirun -np nprocs``; return each rank's stdout."""
    if not mpirun_available():
        import pytest

        pytest.skip("mpirun not found: install Open MPI (make setup does)")
    timeout = runner_timeout(timeout)
    with tempfile.TemporaryDirectory(prefix="commopt-mpi-") as tmp:
        workdir = Path(tmp)
        script = _write_script(code, workdir)
        outdir = workdir / "out"
        cmd = [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            str(nprocs),
            "--mca",
            "btl",
            "self,tcp,vader",
            *LOOPBACK_MCA,
            "--bind-to",
            "none",
            # Ranks outnumber cores: busy-polling ranks would starve each other.
            *(
                ()
                if "mpi_yield_when_idle" in mpirun_args
                else ("--mca", "mpi_yield_when_idle", "1")
            ),
            "--output-filename",
            str(outdir),
            *mpirun_args,
            PYTHON,
            str(script),
            *args,
        ]
        proc = subprocess.Popen(
            cmd,
            env=_base_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd=str(REPO),
        )
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            ranks = _descendants(proc.pid)  # before mpirun dies and they are orphans
            _dump_stacks(proc.pid)
            # mpirun's ranks run in process groups of their own: the group's SIGKILL misses them.
            for pid in [*ranks, proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        results = []
        for r in range(nprocs):
            rdir = outdir / "1" / f"rank.{r}"
            rout = (rdir / "stdout").read_text() if (rdir / "stdout").exists() else ""
            rerr = (rdir / "stderr").read_text() if (rdir / "stderr").exists() else ""
            if timed_out:
                rc = None
            elif proc.returncode == 0:
                rc = 0
            else:  # mpirun failed: blame the ranks that printed a Python error
                rc = proc.returncode if ("Traceback" in rerr or "Error" in rerr) else 0
            results.append((r, rc, rout, rerr))
        if proc.returncode != 0 and not timed_out and all(rc == 0 for _, rc, _, _ in results):
            # No rank printed an error: mpirun itself (or a rank killed by a signal) failed.
            results[0] = (0, proc.returncode, out, err + results[0][3])
        return _report(results, timeout, f"mpirun -np {nprocs}")


def run_torch(
    code: str,
    nprocs: int,
    *,
    timeout: float = 120,
    env: dict | None = None,
    args: list[str] | tuple = (),
) -> list[str]:
    """Run ``code`` as ``nprocs`` processes with torch.distributed's env vars; return stdouts."""
    timeout = runner_timeout(timeout)
    with tempfile.TemporaryDirectory(prefix="commopt-torch-") as tmp:
        script = _write_script(code, Path(tmp))
        port = free_port()
        procs = []
        for r in range(nprocs):
            e = _base_env(env)
            e.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(r),
                WORLD_SIZE=str(nprocs),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(nprocs),
                GLOO_SOCKET_IFNAME=e.get("GLOO_SOCKET_IFNAME", "lo"),
            )
            procs.append(
                subprocess.Popen(
                    [PYTHON, str(script), *args],
                    env=e,
                    cwd=str(REPO),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        results: list[tuple[int, int | None, str, str]] = []
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                results.append((r, p.returncode, out, err))
            except subprocess.TimeoutExpired:
                # Every rank still running prints its stacks at once, then they are all killed.
                hung = {q for q, proc in enumerate(procs) if q >= r and proc.poll() is None}
                for q in hung:
                    _signal_group(procs[q].pid, signal.SIGUSR1)
                time.sleep(2.0)
                for q in range(r, nprocs):
                    _signal_group(procs[q].pid, signal.SIGKILL)
                    out, err = procs[q].communicate()
                    results.append((q, None if q in hung else procs[q].returncode, out, err))
                break
        # A rank that failed makes its peers time out or error: report the root cause first.
        return _report(results, timeout, f"torch.distributed x{nprocs}")
