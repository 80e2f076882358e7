"""torch.distributed ranks without torchrun: each rank's command line and environment.

    >>> specs = local_rank_specs(2, ["python", "train.py"], port=29500)
    >>> [(s.env["RANK"], s.env["WORLD_SIZE"], s.env["MASTER_ADDR"]) for s in specs]
    [('0', '2', '127.0.0.1'), ('1', '2', '127.0.0.1')]

Ranks get the variables torchrun sets (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK) and GLOO_SOCKET_IFNAME, so gloo binds to the right interface:
loopback here, the data link on an emulated cluster. On an emulated cluster the rendezvous
store also lives on the data network: ranks never touch the control network.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from commopt.testbed.agent import host_prefix
from commopt.testbed.mpirun import cluster_env
from commopt.testbed.netns import EmulatedCluster

#: On an emulated cluster host0's namespace is fresh, so a fixed port is always free there.
CLUSTER_MASTER_PORT = 29500


@dataclass
class RankSpec:
    rank: int
    argv: list[str]
    env: dict[str, str]  # added to the launcher's own environment


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel picks it; not reserved, so use it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_env(rank: int, nprocs: int, per_node: int, addr: str, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(min(per_node, nprocs - rank // per_node * per_node)),
        "GROUP_RANK": str(rank // per_node),
    }


def local_rank_specs(
    nprocs: int,
    command: list[str],
    *,
    ranks_per_node: int | None = None,
    port: int | None = None,
    ifname: str = "lo",
) -> list[RankSpec]:
    """Ranks on this machine; with ``ranks_per_node`` they see fake nodes node0, node1, ..."""
    port = free_port() if port is None else port
    per_node = ranks_per_node or nprocs
    specs = []
    for r in range(nprocs):
        env = _torch_env(r, nprocs, per_node, "127.0.0.1", port)
        env["GLOO_SOCKET_IFNAME"] = ifname
        if per_node < nprocs:
            env["COMMOPT_NODE_NAME"] = f"node{r // per_node}"
        specs.append(RankSpec(r, list(command), env))
    return specs


def cluster_rank_specs(
    cluster: EmulatedCluster, nprocs: int, ranks_per_host: int, command: list[str]
) -> list[RankSpec]:
    """Ranks placed ``ranks_per_host`` per emulated host, rank 0 on host0."""
    specs = []
    for r in range(nprocs):
        host = cluster.hosts[r // ranks_per_host]
        env = _torch_env(r, nprocs, ranks_per_host, cluster.hosts[0].data_ip, CLUSTER_MASTER_PORT)
        env.update(cluster_env(cluster))
        specs.append(RankSpec(r, host_prefix(host) + list(command), env))
    return specs
