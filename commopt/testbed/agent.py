"""The launcher agent: how mpirun "logs in" to an emulated host.

mpirun starts its daemons on remote hosts with ``ssh HOST COMMAND...``. Given
``--mca plm_rsh_agent AGENT`` it runs ``AGENT HOST COMMAND...`` instead; our agent maps HOST
(the host's control address or name) to its namespace and runs COMMAND there, in a UTS
namespace of its own whose host name is the emulated host's, with COMMOPT_NODE_NAME set.
Like ssh, it joins the words of COMMAND and hands them to a shell.

    >>> script = agent_script(cluster)  # doctest: +SKIP
    >>> subprocess.run([script, "host1", "hostname"])  # doctest: +SKIP
    host1
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from commopt.testbed.netns import EmulatedCluster, Host


def host_prefix(host: Host) -> list[str]:
    """The argv prefix that runs a command as a process of ``host``.

    ``unshare --uts`` gives the host its own host name, so anything that tells nodes apart
    by ``gethostname()`` (as many libraries do) sees distinct nodes.
    """
    return [
        "ip",
        "netns",
        "exec",
        host.netns,
        "unshare",
        "--uts",
        "sh",
        "-c",
        'echo "$0" > /proc/sys/kernel/hostname && exec env COMMOPT_NODE_NAME="$0" "$@"',
        host.name,
    ]


def agent_script(cluster: EmulatedCluster) -> Path:
    """Write this run's agent into its work directory and return its path."""
    cases = []
    for h in cluster.hosts:
        prefix = " ".join(shlex.quote(a) for a in host_prefix(h))
        cases.append(f'  {h.ctl_ip}|{h.name}|{h.netns}) exec {prefix} sh -c "$*" ;;')
    body = "\n".join(
        [
            "#!/bin/sh",
            f"# Written by commopt launch for emulated-cluster run {cluster.slot}; removed with it.",
            "# Usage, like ssh: agent [ssh options] HOST COMMAND...",
            'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done',
            "host=$1; shift",
            'case "$host" in',
            *cases,
            "  *) echo \"commopt launch agent: no emulated host called '$host'\" >&2; exit 255 ;;",
            "esac",
            "",
        ]
    )
    path = cluster.workdir / "agent.sh"
    path.write_text(body)
    os.chmod(path, 0o755)
    return path
