"""The emulated cluster: namespaces come and go, links run at their rate, MPI and gloo work.

Needs root and network namespaces; every test here skips with the reason where they are missing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from commopt.commands.launch import launch_argv
from commopt.testbed import (
    TestbedUnavailable,
    emulated_cluster,
    format_rate,
    measure_link,
    parse_rate,
    unavailable_reason,
)
from commopt.testbed.netns import ETC_NETNS, _lock_path, list_namespaces
from tests.multirank import launch, needs_mpirun

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
_REASON = unavailable_reason()
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.netns,
    pytest.mark.skipif(_REASON is not None, reason=f"emulated cluster: {_REASON}"),
]


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def run_slot(stderr: str) -> int:
    m = re.search(r"run (\d+)", stderr)
    assert m, f"launch did not say which run it was:\n{stderr}"
    return int(m.group(1))


def assert_run_gone(slot: int, links_before: set[str]) -> None:
    left = [n for n in list_namespaces() if n.startswith(f"commopt{slot}-")]
    assert left == [], f"namespaces of run {slot} survived: {left}"
    assert not any(p.name.startswith(f"commopt{slot}-") for p in ETC_NETNS.glob("*"))
    assert root_links() == links_before, "the run changed the root namespace's interfaces"
    assert workdirs(slot) == [], f"work directories of run {slot} survived"


def workdirs(slot: int) -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob(f"commopt-testbed{slot}-*"))


# -- set-up and teardown -----------------------------------------------------------------------


def test_hosts_have_two_networks_and_no_way_out():
    before = root_links()
    with emulated_cluster(2, "1gbit") as c:
        assert set(c.namespaces) <= set(list_namespaces())
        addrs = subprocess.run(
            c.host_argv(1, ["ip", "-j", "addr"]), capture_output=True, text=True, check=True
        ).stdout
        ips = {a["local"] for link in json.loads(addrs) for a in link.get("addr_info", [])}
        # IPv4 only, beside loopback: no IPv6 link-local address to reach the other hosts by.
        assert ips - {"::1"} == {"127.0.0.1", c.hosts[1].data_ip, c.hosts[1].ctl_ip}
        routes = subprocess.run(
            c.host_argv(1, ["ip", "route"]), capture_output=True, text=True
        ).stdout
        assert "default" not in routes
        # Nothing outside the run is reachable: the kernel refuses before a packet is sent.
        probe = (
            "import socket; s = socket.socket(); s.settimeout(2)\n"
            "try:\n    s.connect(('192.0.2.1', 9)); print('connected')\n"
            "except OSError as e:\n    print(e.errno)"
        )
        out = subprocess.run(c.host_argv(0, [PY, "-c", probe]), capture_output=True, text=True)
        assert out.stdout.strip() == "101", out  # ENETUNREACH
        qdisc = subprocess.run(
            c.host_argv(0, ["tc", "qdisc", "show", "dev", "data0"]), capture_output=True, text=True
        ).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        assert root_links() == before
        names, slot = list(c.namespaces), c.slot
        assert _lock_path(slot).exists()
    assert not set(names) & set(list_namespaces())
    assert not _lock_path(slot).exists()
    assert not any((ETC_NETNS / n).exists() for n in names)


def test_teardown_after_an_exception_and_two_runs_side_by_side():
    with (
        pytest.raises(RuntimeError, match="boom"),
        emulated_cluster(2, "1gbit") as a,
        emulated_cluster(2, None) as b,
    ):
        assert a.slot != b.slot and not set(a.namespaces) & set(b.namespaces)
        # A process left running inside a host does not keep its namespace alive.
        subprocess.Popen(a.host_argv(0, ["sleep", "60"]))
        names = a.namespaces + b.namespaces
        raise RuntimeError("boom")
    assert not set(names) & set(list_namespaces())


@needs_mpirun
def test_failing_job_leaves_nothing_behind():
    before = root_links()
    r = launch("-n", "2", "--link", "1gbit", "--", "sh", "-c", "exit 7")
    assert r.returncode == 7, r.stderr
    assert_run_gone(run_slot(r.stderr), before)


def _sleep_on_cluster() -> subprocess.Popen:
    """A 2-host job that sleeps a minute; its stderr's first line says the cluster is up."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = launch_argv(2, "--link", "1gbit", "--launcher", "torch", "--", "sleep", "60")
    return subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)


def test_sigterm_mid_job_leaves_nothing_behind():
    before = root_links()
    p = _sleep_on_cluster()
    first = p.stderr.readline()  # printed once the cluster is up
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    _, rest = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, first + rest
    assert_run_gone(run_slot(first), before)


def test_cleanup_after_sigkill():
    """SIGKILL leaves no chance to clean up; `commopt launch --cleanup` finds what is left."""
    before = root_links()
    p = _sleep_on_cluster()
    slot = run_slot(p.stderr.readline())
    p.kill()
    p.wait(timeout=30)
    assert any(n.startswith(f"commopt{slot}-") for n in list_namespaces())
    left = workdirs(slot)
    assert left, "a SIGKILLed run leaves its work directory"
    r = launch("--cleanup")
    assert r.returncode == 0 and f"commopt{slot}-h0" in r.stdout, r.stdout + r.stderr
    assert all(str(d) in r.stdout for d in left), r.stdout
    assert_run_gone(slot, before)


def test_clear_refusal_when_it_cannot_run():
    with pytest.raises(ValueError, match="1 to 253 hosts"), emulated_cluster(0):
        pass
    assert issubclass(TestbedUnavailable, RuntimeError)


# -- the link ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rate, nbytes", [("1gbit", 32 * 2**20), ("200mbit", 6 * 2**20)])
def test_shaped_link_runs_at_its_rate(rate, nbytes):
    bits = parse_rate(rate)
    with emulated_cluster(2, rate) as c:
        # Best of three: a busy CPU can only slow a transfer down, never speed it past tbf.
        fwd = max(measure_link(c, 0, 1, nbytes) for _ in range(3))
        back = measure_link(c, 1, 0, nbytes)
    for measured in (fwd, back):
        assert 0.9 * bits <= measured <= 1.1 * bits, f"{rate} link measured {format_rate(measured)}"


# -- jobs over the link ------------------------------------------------------------------------

NBYTES = 8 * 2**20  # per rank: 2 ranks move 2 * (n-1)/n * 8 MiB = 8 MiB each way over the link

MPI_JOB = f"""
import os, socket, sys, time
import numpy as np
from mpi4py import MPI
def tx(dev):
    return int(open(f"/sys/class/net/{{dev}}/statistics/tx_bytes").read())
comm = MPI.COMM_WORLD
x = np.ones({NBYTES} // 8); y = np.empty_like(x)
comm.Allreduce(x[:8], y[:8])                       # connections up before timing
comm.Barrier()
d0, c0, t0 = tx("data0"), tx("ctl0"), time.perf_counter()
comm.Allreduce(x, y)
dt = time.perf_counter() - t0
comm.Barrier()   # the peer has all our bytes: none wait in a socket buffer any more
d1, c1 = tx("data0"), tx("ctl0")
sys.stdout.write(f"{{comm.rank}} {{socket.gethostname()}} {{os.environ['COMMOPT_NODE_NAME']}} "
                 f"{{int(y[0])}} {{d1 - d0}} {{c1 - c0}} {{dt:.4f}}\\n")
"""

GLOO_JOB = f"""
import os, socket, sys, time
import torch, torch.distributed as dist
def tx(dev):
    return int(open(f"/sys/class/net/{{dev}}/statistics/tx_bytes").read())
dist.init_process_group("gloo")
x = torch.ones({NBYTES} // 4)
dist.all_reduce(torch.ones(8))
dist.barrier()
d0, c0, t0 = tx("data0"), tx("ctl0"), time.perf_counter()
dist.all_reduce(x)
dt = time.perf_counter() - t0
dist.barrier()   # the peer has all our bytes: none wait in a socket buffer any more
d1, c1 = tx("data0"), tx("ctl0")
sys.stdout.write(f"{{dist.get_rank()}} {{socket.gethostname()}} {{os.environ['COMMOPT_NODE_NAME']}} "
                 f"{{int(x[0])}} {{d1 - d0}} {{c1 - c0}} {{dt:.4f}}\\n")
dist.destroy_process_group()
"""


def check_two_host_allreduce(stdout: str, rate_bits: int) -> None:
    rows = sorted(line.split() for line in stdout.splitlines() if line.strip())
    assert [r[:4] for r in rows] == [["0", "host0", "host0", "2"], ["1", "host1", "host1", "2"]]
    for _, _, _, _, data_tx, ctl_tx, seconds in rows:
        # The payload crossed the data link, not the control link ...
        assert int(data_tx) >= NBYTES, rows
        assert int(ctl_tx) < NBYTES // 10, rows
        # ... and took at least as long as the link rate allows.
        assert float(seconds) >= 0.9 * NBYTES * 8 / rate_bits, rows


@needs_mpirun
def test_two_host_mpi_job_over_the_shaped_link():
    pytest.importorskip("mpi4py", reason="mpi4py not installed: pip install mpi4py")
    before = root_links()
    r = launch("-n", "2", "--link", "1gbit", "--", PY, "-c", MPI_JOB)
    assert r.returncode == 0, r.stderr
    check_two_host_allreduce(r.stdout, 10**9)
    assert_run_gone(run_slot(r.stderr), before)


def test_two_host_gloo_job_over_the_shaped_link():
    r = launch("-n", "2", "--link", "1gbit", "--launcher", "torch", "--", PY, "-c", GLOO_JOB)
    assert r.returncode == 0, r.stderr
    check_two_host_allreduce(r.stdout, 10**9)


@needs_mpirun
def test_two_ranks_per_host_share_a_node_name():
    r = launch(
        "-n",
        "4",
        "--link",
        "1gbit",
        "--ranks-per-host",
        "2",
        "--",
        "sh",
        "-c",
        "echo $OMPI_COMM_WORLD_RANK $(cat /proc/sys/kernel/hostname) $COMMOPT_NODE_NAME "
        "$COMMOPT_LINK_BITS",
    )
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [
        "0 host0 host0 1000000000",
        "1 host0 host0 1000000000",
        "2 host1 host1 1000000000",
        "3 host1 host1 1000000000",
    ]
