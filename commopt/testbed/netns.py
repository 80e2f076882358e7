"""An emulated cluster on one machine: one Linux network namespace per host.

Layout of one run (slot ``s``, picked under a lock so concurrent runs never share names)::

    commopt<s>-sw   the switch and head: bridge ``brdata`` (no address) joins every host's
                    data link; bridge ``brctl`` (10.232.s.254) joins their control links and
                    is where mpirun runs, so its daemons reach it without touching the
                    shaped links.
    commopt<s>-h<i> host i: ``data0`` 10.231.s.(i+1)/24, egress shaped to the link rate,
                    ``ctl0`` 10.232.s.(i+1)/24 unshaped; ``lo``. No default route.

The switch-side end of each data link is shaped too, so every host sends and receives at the
link rate, as on a switch port. Nothing is added to the root namespace and IP forwarding stays
off everywhere, so no packet can leave the namespaces of the run.

    >>> with emulated_cluster(2, rate="1gbit") as cluster:  # doctest: +SKIP
    ...     subprocess.run(cluster.host_argv(1, ["ip", "-br", "addr"]))

Everything is removed on exit, on an exception, on Ctrl-C and on SIGTERM/SIGHUP. A run killed
with SIGKILL leaves its namespaces and its work directory (``$TMPDIR/commopt-testbed<s>-*``)
behind; the next run that takes the same slot (or ``cleanup_stale()``, ``commopt launch
--cleanup``) removes them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from commopt.testbed.shaping import parse_rate, tbf_command

PREFIX = "commopt"
DATA_IFNAME = "data0"
CTL_IFNAME = "ctl0"
MAX_SLOTS = 250
MAX_HOSTS = 253
ETC_NETNS = Path("/etc/netns")
WORKDIR_PREFIX = "commopt-testbed"
_LOCK_DIRS = ("/run/commopt-testbed", os.path.join(tempfile.gettempdir(), "commopt-testbed"))


class TestbedUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster (not root, no namespaces, no tc)."""

    __test__ = False  # not a pytest test class, despite the name


@dataclass(frozen=True)
class Host:
    index: int
    name: str  # the host name ranks see (COMMOPT_NODE_NAME), e.g. "host0"
    netns: str  # e.g. "commopt7-h0"
    data_ip: str
    ctl_ip: str


@dataclass
class EmulatedCluster:
    slot: int
    rate_bits: int | None
    hosts: list[Host]
    switch: str  # namespace of the bridges; mpirun runs here
    data_cidr: str
    ctl_cidr: str
    head_ip: str  # the switch's address on the control network
    workdir: Path  # run-private files: hostfile, agent script
    data_ifname: str = DATA_IFNAME
    lock_fd: int | None = field(default=None, repr=False)

    @property
    def namespaces(self) -> list[str]:
        return [h.netns for h in self.hosts] + [self.switch]

    def host_argv(self, host: int | Host, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace."""
        h = host if isinstance(host, Host) else self.hosts[host]
        return ["ip", "netns", "exec", h.netns, *argv]

    def head_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run on the control network's head (the switch namespace)."""
        return ["ip", "netns", "exec", self.switch, *argv]


# ---------------------------------------------------------------------------------------------
# availability


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces and tc); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return (
            f"cannot create a network namespace (`ip netns add` said: "
            f"{r.stderr.strip() or r.returncode}); the emulated cluster needs "
            f"CAP_SYS_ADMIN and kernel namespace support"
        )
    try:
        r = _run(
            [
                "tc",
                "-n",
                probe,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "1gbit",
                "burst",
                "65536",
                "latency",
                "20ms",
            ],
            check=False,
        )
        if r.returncode != 0:
            return f"the kernel has no tbf qdisc for link shaping: {r.stderr.strip()}"
    finally:
        _run(["ip", "netns", "delete", probe], check=False)
    return None


# ---------------------------------------------------------------------------------------------
# life cycle


@contextlib.contextmanager
def emulated_cluster(n_hosts: int, rate: str | int | None = "1gbit"):
    """Create ``n_hosts`` hosts joined by links of ``rate`` (None: unshaped); yield the cluster.

    Raises TestbedUnavailable with the reason when the machine cannot do it.
    """
    if not 1 <= n_hosts <= MAX_HOSTS:
        raise ValueError(f"an emulated cluster has 1 to {MAX_HOSTS} hosts, not {n_hosts}")
    rate_bits = None if rate is None else (rate if isinstance(rate, int) else parse_rate(rate))
    reason = unavailable_reason()
    if reason:
        raise TestbedUnavailable(reason)
    cluster = None
    with _signals_raise():
        try:
            cluster = _allocate(n_hosts, rate_bits)
            _build(cluster)
            yield cluster
        finally:
            if cluster is not None:
                teardown(cluster)


def teardown(cluster: EmulatedCluster) -> None:
    """Stop every process left in the run's namespaces, delete them, release the slot."""
    # Signals must not interrupt the cleanup half-way.
    with _signals_deferred():
        _remove_namespaces(cluster.namespaces)
        shutil.rmtree(cluster.workdir, ignore_errors=True)
        if cluster.lock_fd is not None:
            _unlock(cluster.slot, cluster.lock_fd)
            cluster.lock_fd = None


def cleanup_stale() -> list[str]:
    """Remove namespaces of runs that died without cleaning up; return their names."""
    removed = []
    existing = list_namespaces()
    if ETC_NETNS.is_dir():  # a run killed between writing these and creating namespaces
        existing += [p.name for p in ETC_NETNS.iterdir() if p.name not in existing]
    workdirs = _workdirs()
    for slot in range(MAX_SLOTS):
        names = _slot_namespaces(slot, existing)
        dirs = workdirs.get(slot, [])
        if not names and not dirs and not _lock_path(slot).exists():
            continue
        fd = _try_lock(slot)
        if fd is None:
            continue  # a live run holds it
        try:
            _remove_namespaces(names)
            removed += names
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(str(d))
        finally:
            _unlock(slot, fd)  # also drops lock files of old runs
    return removed


def _workdirs() -> dict[int, list[Path]]:
    """Work directories of runs (``commopt-testbed<slot>-*`` in the temp dir), by slot."""
    found: dict[int, list[Path]] = {}
    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        slot = path.name[len(WORKDIR_PREFIX) :].split("-", 1)[0]
        if slot.isdigit() and path.is_dir() and not path.is_symlink():
            found.setdefault(int(slot), []).append(path)
    return found


def list_namespaces() -> list[str]:
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# internals


def _run(argv: list[str], *, check: bool = True, input: str | None = None):
    r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {r.stderr.strip()}")
    return r


def _lock_dir() -> Path:
    for d in _LOCK_DIRS:
        try:
            os.makedirs(d, exist_ok=True)
            return Path(d)
        except OSError:
            continue
    raise TestbedUnavailable(f"no writable directory for run locks among {_LOCK_DIRS}")


def _lock_path(slot: int) -> Path:
    return _lock_dir() / f"slot-{slot}.lock"


def _try_lock(slot: int) -> int | None:
    path = _lock_path(slot)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return None
        raise
    # The holder before us unlinks the file as it lets go: a lock on an unlinked file
    # guards nothing, so it only counts if the path still names the file we locked.
    try:
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


def _unlock(slot: int, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_lock_path(slot))  # while still holding it, so nobody else is mid-claim
    os.close(fd)


def _slot_namespaces(slot: int, names: list[str] | None = None) -> list[str]:
    if names is None:
        names = list_namespaces()
        if ETC_NETNS.is_dir():
            names += [p.name for p in ETC_NETNS.iterdir() if p.name not in names]
    return [n for n in names if n.startswith(f"{PREFIX}{slot}-")]


def _allocate(n_hosts: int, rate_bits: int | None) -> EmulatedCluster:
    # Start at a pid-dependent slot so concurrent runs rarely even contend for a lock.
    start = os.getpid() % MAX_SLOTS
    for k in range(MAX_SLOTS):
        slot = (start + k) % MAX_SLOTS
        fd = _try_lock(slot)
        if fd is None:
            continue
        stale = _slot_namespaces(slot)
        if stale:  # left by a run that was killed outright: ours now
            _remove_namespaces(stale)
        for old in _workdirs().get(slot, []):
            shutil.rmtree(old, ignore_errors=True)
        # Addresses only exist inside this run's namespaces, so runs cannot collide on them;
        # the slot in the third octet just makes `ip addr` output say which run it is.
        hosts = [
            Host(
                i,
                f"host{i}",
                f"{PREFIX}{slot}-h{i}",
                f"10.231.{slot}.{i + 1}",
                f"10.232.{slot}.{i + 1}",
            )
            for i in range(n_hosts)
        ]
        workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{slot}-"))
        return EmulatedCluster(
            slot=slot,
            rate_bits=rate_bits,
            hosts=hosts,
            switch=f"{PREFIX}{slot}-sw",
            data_cidr=f"10.231.{slot}.0/24",
            ctl_cidr=f"10.232.{slot}.0/24",
            head_ip=f"10.232.{slot}.254",
            workdir=workdir,
            lock_fd=fd,
        )
    raise TestbedUnavailable(f"all {MAX_SLOTS} emulated-cluster slots are in use")


def _build(c: EmulatedCluster) -> None:
    _write_hosts_files(c)
    _run(["ip", "-batch", "-"], input="".join(f"netns add {ns}\n" for ns in c.namespaces))
    sw = [
        "link set lo up",
        "link add brdata type bridge",
        "link set brdata addrgenmode none",
        "link set brdata up",
        "link add brctl type bridge",
        "link set brctl addrgenmode none",
        f"addr add {c.head_ip}/24 dev brctl",
        "link set brctl up",
    ]
    for h in c.hosts:
        i = h.index
        # Create each veth pair from the switch side with the other end already in the host.
        sw += [
            f"link add d{i} type veth peer name {DATA_IFNAME} netns {h.netns}",
            f"link add c{i} type veth peer name {CTL_IFNAME} netns {h.netns}",
            f"link set d{i} addrgenmode none",
            f"link set c{i} addrgenmode none",
            f"link set d{i} master brdata up",
            f"link set c{i} master brctl up",
        ]
    _run(["ip", "-n", c.switch, "-batch", "-"], input="\n".join(sw) + "\n")
    for h in c.hosts:
        # addrgenmode none: no IPv6 link-local addresses, so IPv4 on data0 is the only way out.
        cmds = [
            "link set lo up",
            f"link set {DATA_IFNAME} addrgenmode none",
            f"link set {CTL_IFNAME} addrgenmode none",
            f"addr add {h.data_ip}/24 dev {DATA_IFNAME}",
            f"addr add {h.ctl_ip}/24 dev {CTL_IFNAME}",
            f"link set {DATA_IFNAME} up",
            f"link set {CTL_IFNAME} up",
        ]
        _run(["ip", "-n", h.netns, "-batch", "-"], input="\n".join(cmds) + "\n")
    if c.rate_bits is not None:
        _run(
            ["tc", "-n", c.switch, "-batch", "-"],
            input="".join(tbf_command(f"d{h.index}", c.rate_bits) + "\n" for h in c.hosts),
        )
        for h in c.hosts:
            _run(
                ["tc", "-n", h.netns, "-batch", "-"],
                input=tbf_command(DATA_IFNAME, c.rate_bits) + "\n",
            )


def _write_hosts_files(c: EmulatedCluster) -> None:
    # `ip netns exec NS` shows /etc/netns/NS/hosts as /etc/hosts: the hosts resolve each
    # other's names to data addresses, as a cluster's DNS would (and gloo or c10d can look
    # up the peers they see).
    lines = ["127.0.0.1 localhost"] + [f"{h.data_ip} {h.name}" for h in c.hosts]
    for ns in c.namespaces:
        d = ETC_NETNS / ns
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text("\n".join(lines) + "\n")


def _remove_namespaces(names: list[str]) -> None:
    for n in names:
        shutil.rmtree(ETC_NETNS / n, ignore_errors=True)
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()  # only if empty: other tools (and other runs) may use it
    existing = set(list_namespaces())
    names = [n for n in names if n in existing]
    if not names:
        return
    # A namespace lives on while a process is inside it: stop the run's processes first.
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        pids = _pids_in(names)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _pids_in(names):
            time.sleep(0.05)
    _run(["ip", "-batch", "-"], input="".join(f"netns delete {n}\n" for n in names), check=False)
    left = set(names) & set(list_namespaces())
    if left:
        raise RuntimeError(
            f"could not delete namespaces {sorted(left)}; remove them with `ip netns delete NAME`"
        )


def _pids_in(names: list[str]) -> list[int]:
    me = os.getpid()
    pids = []
    for n in names:
        r = _run(["ip", "netns", "pids", n], check=False)
        pids += [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != me]
    return pids


class _Terminated(SystemExit):
    """SIGTERM/SIGHUP turned into an exception so `finally` blocks run."""


@contextlib.contextmanager
def _signals_raise():
    def handler(signum, frame):
        raise _Terminated(128 + signum)

    with _swap_handlers(handler):
        yield


@contextlib.contextmanager
def _signals_deferred():
    got = []
    with _swap_handlers(lambda signum, frame: got.append(signum), include_int=True):
        yield
    if got:
        raise _Terminated(128 + got[0]) if got[0] != signal.SIGINT else KeyboardInterrupt


@contextlib.contextmanager
def _swap_handlers(handler, include_int: bool = False):
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; the caller's own handling applies
        return
    sigs = [signal.SIGTERM, signal.SIGHUP] + ([signal.SIGINT] if include_int else [])
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
