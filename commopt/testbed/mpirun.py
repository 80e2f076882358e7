"""mpirun command lines: N ranks on this machine, or on the hosts of an emulated cluster.

    >>> mpirun_local_argv(2, ["python", "train.py"], is_root=False, ncpus=2, flavour="openmpi")[:5]
    ['mpirun', '-n', '2', '--bind-to', 'none']

On an emulated cluster, mpirun runs on the control network's head and starts one daemon per
host through the agent script; every MPI byte between ranks on different hosts goes through
the shaped data links (only Open MPI's TCP transport is allowed between hosts, and only on the
data subnet), while mpirun's own traffic uses the unshaped control network.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from commopt.testbed.agent import agent_script
from commopt.testbed.netns import EmulatedCluster


def mpirun_path() -> str:
    path = shutil.which("mpirun")
    if path is None:
        raise FileNotFoundError(
            "mpirun not found: install Open MPI (e.g. apt-get install "
            "openmpi-bin libopenmpi-dev) or use --launcher torch"
        )
    return path


@functools.cache
def mpirun_flavour(path: str | None = None) -> str:
    """Which MPI's ``mpirun`` is on the PATH (or at ``path``): ``"openmpi"``, ``"mpich"`` (its
    Hydra launcher, also Intel MPI's) or ``"unknown"``; their flags differ."""
    path = path or shutil.which("mpirun")
    if path is None:
        return "unknown"
    try:
        proc = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return flavour_of(proc.stdout + proc.stderr)


def flavour_of(version_text: str) -> str:
    """The flavour that ``mpirun --version`` printed.

    >>> flavour_of("mpirun (Open MPI) 4.1.4")
    'openmpi'
    >>> flavour_of("HYDRA build details: Version 4.2.0")
    'mpich'
    """
    text = version_text.lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return "mpich"
    return "unknown"


def _common_flags(nprocs: int, *, is_root: bool, ncpus: int) -> list[str]:
    flags = []
    if is_root:
        flags.append("--allow-run-as-root")
    if nprocs > ncpus:
        flags.append("--oversubscribe")
    # Ranks share a few cores with each other (and on an emulated cluster every daemon thinks
    # it owns the whole machine): pinning would stack ranks on the same core.
    flags += ["--bind-to", "none"]
    return flags


#: Open MPI's TCP eager limit commopt launch passes (bytes, header included): messages up to
#: about 1 MiB go without a rendezvous handshake. Open MPI 4.1's TCP transport queues a
#: handshake reply behind any bulk data already on the same connection, so when both ends of
#: a link send large messages at once (every 2-rank allreduce, alltoall, allgather), one
#: direction waits for the other and the exchange takes twice the link's time. Messages
#: under the eager limit need no reply; the mpi communicator cuts large transfers into
#: segments just under it (commopt/comm/mpi/settings.py, docs/benchmarks-allreduce.md). The default
#: 64 KiB also works, with 16x more segments and more per-segment overhead.
TCP_EAGER_LIMIT = 1 << 20


def tcp_mca_defaults(environ=None) -> dict[str, str]:
    """MCA settings for Open MPI's TCP transport, unless the environment chooses its own.

    >>> tcp_mca_defaults({})
    {'btl_tcp_eager_limit': '1048576', 'btl_tcp_rndv_eager_limit': '1048576'}
    >>> tcp_mca_defaults({"OMPI_MCA_btl_tcp_eager_limit": "65536"})
    {}
    """
    environ = os.environ if environ is None else environ
    names = ("btl_tcp_eager_limit", "btl_tcp_rndv_eager_limit")
    # Both or neither: the rendezvous limit must not exceed the eager limit.
    if any(f"OMPI_MCA_{name}" in environ for name in names):
        return {}
    return {name: str(TCP_EAGER_LIMIT) for name in names}


#: Prefixes of the variables mpirun hands every rank as this launcher's environment has them:
#: commopt's own settings (COMMOPT_COMM_TIMEOUT, ...) and the timeouts of the libraries under it.
EXPORTED_PREFIXES = ("COMMOPT_", "TORCH_NCCL_", "HOROVOD_", "NCCL_")
#: Set per node by the launcher itself, never copied from its environment.
_PER_NODE = ("COMMOPT_NODE_NAME",)


def export_flags(environ=None) -> list[str]:
    """``-x NAME`` for each variable of ``environ`` that every rank must see.

    Ranks that mpirun starts on this machine inherit its environment; ranks on other hosts
    (ssh, or an emulated host's agent) get only what ``-x`` names, so this names them.

    >>> export_flags({"COMMOPT_COMM_TIMEOUT": "5", "COMMOPT_NODE_NAME": "n0", "HOME": "/"})
    ['-x', 'COMMOPT_COMM_TIMEOUT']
    """
    environ = os.environ if environ is None else environ
    names = sorted(k for k in environ if k.startswith(EXPORTED_PREFIXES) and k not in _PER_NODE)
    return [flag for name in names for flag in ("-x", name)]


def _mca_flags(settings: dict[str, str]) -> list[str]:
    flags: list[str] = []
    for key, value in settings.items():
        flags += ["--mca", key, value]
    return flags


#: Open MPI's flags for ranks all on this machine: their TCP traffic, if any, stays on loopback.
LOOPBACK_MCA = ("--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo")


def mpirun_local_argv(
    nprocs: int,
    command: list[str],
    *,
    ranks_per_node: int | None = None,
    is_root: bool | None = None,
    ncpus: int | None = None,
    flavour: str | None = None,
) -> list[str]:
    """mpirun starting ``nprocs`` ranks here, with the flags of its ``flavour`` (default: the
    ``mpirun`` on the PATH; Open MPI's unless it is MPICH's Hydra).

    With ``ranks_per_node`` the ranks are told (COMMOPT_NODE_NAME) that they sit on nodes of
    that many ranks each: node0 has ranks 0..K-1, and so on. One app context per fake node
    gives each its own variable.
    """
    if flavour is None:
        flavour = mpirun_flavour()
    if flavour == "mpich":
        return _hydra_local_argv(nprocs, command, ranks_per_node)
    is_root = os.geteuid() == 0 if is_root is None else is_root
    ncpus = (os.cpu_count() or 1) if ncpus is None else ncpus
    flags = (
        _common_flags(nprocs, is_root=is_root, ncpus=ncpus)
        + list(LOOPBACK_MCA)
        + _mca_flags(tcp_mca_defaults())
        + export_flags()
    )
    if ranks_per_node is None or ranks_per_node >= nprocs:
        return ["mpirun", "-n", str(nprocs), *flags, *command]
    contexts: list[str] = []
    for node, first in enumerate(range(0, nprocs, ranks_per_node)):
        count = min(ranks_per_node, nprocs - first)
        if contexts:
            contexts.append(":")
        contexts += ["-n", str(count), "-x", f"COMMOPT_NODE_NAME=node{node}", *command]
    return ["mpirun", *flags, *contexts]


def _hydra_local_argv(nprocs: int, command: list[str], ranks_per_node: int | None) -> list[str]:
    """MPICH's Hydra ``mpirun``: ranks inherit this environment (Hydra passes all of it on one
    machine), run as root without a flag, and are not pinned.

    >>> _hydra_local_argv(4, ["python", "t.py"], 2)  # doctest: +NORMALIZE_WHITESPACE
    ['mpirun', '-bind-to', 'none', '-n', '2', '-env', 'COMMOPT_NODE_NAME', 'node0', 'python',
     't.py', ':', '-n', '2', '-env', 'COMMOPT_NODE_NAME', 'node1', 'python', 't.py']
    """
    if ranks_per_node is None or ranks_per_node >= nprocs:
        return ["mpirun", "-bind-to", "none", "-n", str(nprocs), *command]
    contexts: list[str] = []
    for node, first in enumerate(range(0, nprocs, ranks_per_node)):
        if contexts:
            contexts.append(":")
        count = min(ranks_per_node, nprocs - first)
        contexts += ["-n", str(count), "-env", "COMMOPT_NODE_NAME", f"node{node}", *command]
    return ["mpirun", "-bind-to", "none", *contexts]


def mpirun_cluster_argv(
    cluster: EmulatedCluster,
    nprocs: int,
    ranks_per_host: int,
    command: list[str],
    *,
    ncpus: int | None = None,
) -> list[str]:
    """mpirun that starts ``nprocs`` ranks, ``ranks_per_host`` per emulated host.

    Writes the run's hostfile and agent into ``cluster.workdir``. The returned argv is meant
    to run in the head namespace (``cluster.head_argv``).
    """
    ncpus = (os.cpu_count() or 1) if ncpus is None else ncpus
    hostfile = cluster.workdir / "hostfile"
    hostfile.write_text("".join(f"{h.ctl_ip} slots={ranks_per_host}\n" for h in cluster.hosts))
    agent = agent_script(cluster)
    flags = _common_flags(nprocs, is_root=os.geteuid() == 0, ncpus=ncpus)
    mca = {
        "plm_rsh_agent": str(agent),
        "plm_rsh_no_tree_spawn": "1",  # only mpirun starts daemons
        "oob_tcp_if_include": cluster.ctl_cidr,  # daemons <-> mpirun: control network
        # Ranks: shared memory within a host, TCP on the data network between hosts, and
        # nothing else (UCX or OFI could find a path that bypasses the shaped links).
        "pml": "ob1",
        "btl": "self,vader,tcp",
        "btl_tcp_if_include": cluster.data_cidr,
        "osc": "^ucx",
        **tcp_mca_defaults(),
    }
    argv = [
        mpirun_path(),
        "-n",
        str(nprocs),
        "--hostfile",
        str(hostfile),
        "--map-by",
        "slot",
        *flags,
        *_mca_flags(mca),
    ]
    given = cluster_env(cluster)
    for var, value in given.items():
        argv += ["-x", f"{var}={value}"]
    exported = export_flags({k: v for k, v in os.environ.items() if k not in given})
    return argv + exported + list(command)


def cluster_env(cluster: EmulatedCluster) -> dict[str, str]:
    """Variables every rank on an emulated cluster gets (COMMOPT_NODE_NAME comes per host).

    COMMOPT_LINK_BITS tells benchmarks the link rate, so they can print the limit beside
    what they measure.
    """
    env = {
        "COMMOPT_DATA_IFNAME": cluster.data_ifname,
        "GLOO_SOCKET_IFNAME": cluster.data_ifname,
        "NCCL_SOCKET_IFNAME": cluster.data_ifname,
    }
    if cluster.rate_bits is not None:
        env["COMMOPT_LINK_BITS"] = str(cluster.rate_bits)
    return env


#: Variables an Open MPI singleton (a process that called MPI_Init without mpirun) writes into
#: its environment, besides PMIX_*. Children inherit them, and an mpirun started with them
#: takes itself for part of that singleton's job and exits 1 without a word.
_SINGLETON_VARIABLES = (
    "OMPI_MCA_ess",
    "OMPI_MCA_pmix",
    "OMPI_MCA_orte_ess_num_procs",
    "OMPI_MCA_orte_launch",
    "OMPI_MCA_orte_precondition_transports",
    "OMPI_APP_CTX_NUM_PROCS",
    "ORTE_SCHIZO_DETECTION",
)


def drop_singleton_variables(environ) -> list[str]:
    """Remove from ``environ`` what an MPI singleton parent left there; the names removed.

    Only when the parent was a singleton (``OMPI_MCA_ess=singleton``): a user's own
    ``OMPI_MCA_*`` settings stay.

    >>> env = {"OMPI_MCA_ess": "singleton", "PMIX_RANK": "0", "OMPI_MCA_btl": "tcp,self"}
    >>> drop_singleton_variables(env), env
    (['OMPI_MCA_ess', 'PMIX_RANK'], {'OMPI_MCA_btl': 'tcp,self'})
    >>> drop_singleton_variables({"PMIX_RANK": "0"})
    []
    """
    if environ.get("OMPI_MCA_ess") != "singleton":
        return []
    names = [k for k in environ if k.startswith("PMIX_") or k in _SINGLETON_VARIABLES]
    for name in names:
        del environ[name]
    return names
