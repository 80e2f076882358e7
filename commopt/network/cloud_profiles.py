"""Per-cloud environments for NCCL and MPI: `commopt doctor --profile NAME`.

Each variable comes with the reason to set it and where the advice comes from. Values that
depend on the machine (the interface to use, the plugin folder, the NCCL version) are filled
in from a snapshot (see ``probe.py``); without one, a placeholder says what to put there.

    >>> from commopt.network.cloud_profiles import profile_env, render
    >>> snap = {"interfaces": [{"name": "ens5", "state": "up", "speed_mbps": 100000}]}
    >>> print(render("aws-tcp", profile_env("aws-tcp", snap)).splitlines()[2])
    export NCCL_SOCKET_IFNAME=ens5  # the data interface (fastest up interface here); NCCL and its bootstrap otherwise may pick another [published: AWS TCP practice]
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from commopt.network import nccl_vars
from commopt.network.doctor import fastest_interface

AWS_TCP = "published: AWS TCP practice"
AWS_EFA = "published: AWS EFA practice"
GCP = "published: Google Cloud Fast Socket practice"
AZURE = "published: Azure InfiniBand VM practice"
NCCL_DOCS = "NCCL docs: environment variables"


@dataclass(frozen=True)
class EnvVar:
    """One line of a profile. ``value`` None makes a comment (advice that is not a variable)."""

    name: str
    value: str | None
    reason: str
    source: str


PROFILES = {
    "aws-efa": "AWS instances with EFA (p3dn, p4d, p5): NCCL over libfabric's efa provider",
    "aws-tcp": "AWS instances without EFA: NCCL over TCP sockets (10 Gbit/s per flow on EC2)",
    "gcp-fastsocket": "Google Cloud GPU VMs: NCCL with the Fast Socket transport plugin on gVNIC",
    "azure-ib": "Azure InfiniBand GPU VMs (ND series): NCCL over InfiniBand inside a VM",
    "tcp": "any cluster on plain Ethernet/TCP (on-premises, other clouds)",
}


def _iface(snapshot: dict | None) -> tuple[str, str]:
    best = fastest_interface(snapshot or {})
    if best:
        return best, "the data interface (fastest up interface here)"
    return "<interface>", "the data interface (see `ip -br addr`)"


def _tcp_common(snapshot: dict | None, source: str) -> list[EnvVar]:
    iface, why = _iface(snapshot)
    return [
        EnvVar(
            "NCCL_SOCKET_IFNAME",
            iface,
            f"{why}; NCCL and its bootstrap otherwise may pick another",
            source,
        ),
        EnvVar(
            "GLOO_SOCKET_IFNAME",
            iface,
            "the same interface for torch.distributed's gloo backend",
            "PyTorch docs: gloo",
        ),
        EnvVar(
            "OMPI_MCA_btl_tcp_if_exclude",
            "lo,docker0",
            "keep Open MPI's TCP transport off loopback and the container bridge",
            AWS_TCP,
        ),
    ]


def _plugin_dir(snapshot: dict | None, marker: str) -> str | None:
    for p in (snapshot or {}).get("nccl_net_plugins") or []:
        if marker in p.lower():
            return os.path.dirname(p)
    return None


def _ld_path_line(
    snapshot: dict | None, marker: str, what: str, default_dir: str | None, source: str
) -> EnvVar:
    d = _plugin_dir(snapshot, marker)
    ld = ((snapshot or {}).get("env") or {}).get("LD_LIBRARY_PATH", "")
    if d and d in ld.split(":"):
        return EnvVar(
            "LD_LIBRARY_PATH", None, f"{what} found at {d}, already on LD_LIBRARY_PATH", source
        )
    if d or default_dir:
        return EnvVar(
            "LD_LIBRARY_PATH",
            f"{d or default_dir}:$LD_LIBRARY_PATH",
            f"lets NCCL load {what} (libnccl-net*.so) at start-up"
            + ("" if d else " (default install folder; not found here)"),
            source,
        )
    return EnvVar(
        "LD_LIBRARY_PATH",
        None,
        f"{what} not found here: install it and put its lib folder on LD_LIBRARY_PATH",
        source,
    )


def profile_env(name: str, snapshot: dict | None = None) -> list[EnvVar]:
    """The variables of profile ``name``, filled in from ``snapshot`` where it helps."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of: {', '.join(PROFILES)}")
    nccl = nccl_vars.parse_version(((snapshot or {}).get("versions") or {}).get("nccl"))
    if name == "tcp":
        return _tcp_common(snapshot, NCCL_DOCS) + [
            EnvVar(
                "NCCL_SOCKET_NTHREADS",
                None,
                "socket threads x sockets per thread (at most 64 sockets): measure with "
                "`commopt tune` and export the best pair",
                "NCCL docs; commopt tune",
            ),
        ]
    if name == "aws-tcp":
        return _tcp_common(snapshot, AWS_TCP) + [
            EnvVar(
                "NCCL_SOCKET_NTHREADS",
                "4",
                "several TCP flows per connection get past EC2's 10 Gbit/s per-flow limit",
                AWS_TCP,
            ),
            EnvVar(
                "NCCL_NSOCKS_PERTHREAD",
                "4",
                "4 x 4 = 16 sockets; published about 2x all-reduce throughput above ~1 MB",
                AWS_TCP,
            ),
        ]
    if name == "aws-efa":
        out = [
            EnvVar(
                "FI_PROVIDER",
                "efa",
                "use libfabric's EFA provider; published about 3x the "
                "bus bandwidth of FI_PROVIDER=tcp",
                AWS_EFA,
            ),
            EnvVar(
                "FI_EFA_TX_MIN_CREDITS",
                "64",
                "the EFA provider setting of the published practice",
                AWS_EFA,
            ),
            _ld_path_line(
                snapshot, "ofi", "the aws-ofi-nccl plugin", "/opt/amazon/ofi-nccl/lib", AWS_EFA
            ),
        ]
        if nccl is not None and nccl < (2, 5, 0):
            out.append(
                EnvVar(
                    "NCCL_TREE_THRESHOLD",
                    "0",
                    "this older NCCL's tree threshold, as in the published practice",
                    AWS_EFA,
                )
            )
        else:
            out.append(
                EnvVar(
                    "NCCL_TREE_THRESHOLD",
                    None,
                    "not set: the published practice sets it to 0 only for NCCL < 2.5, "
                    "newer NCCL does not read it",
                    NCCL_DOCS,
                )
            )
        # Bootstrap and MPI still run over TCP: the same interface rules as without EFA.
        ifname, _gloo, mpi_exclude = _tcp_common(snapshot, AWS_EFA)
        out += [ifname, mpi_exclude]
        out.append(
            EnvVar(
                "NCCL_DEBUG",
                None,
                "check once with NCCL_DEBUG=INFO that the log says "
                "'Selected Provider is efa' and expect about 10 GB/s all-reduce bus "
                "bandwidth (p3dn) before training",
                AWS_EFA,
            )
        )
        return out
    if name == "gcp-fastsocket":
        return [
            _ld_path_line(snapshot, "fastsocket", "the NCCL Fast Socket plugin", None, GCP),
            *_tcp_common(snapshot, GCP),
            EnvVar(
                "NCCL_NET_PLUGIN",
                None,
                "nothing else to set: Fast Socket is loaded at run time with no code change; "
                "use gVNIC (up to 100 Gbit/s) and a compact placement policy when creating the "
                "VMs; published +30% BERT-Large training speed on 64 V100",
                GCP,
            ),
        ]
    # azure-ib
    topo = _azure_topo_file(snapshot)
    return [
        EnvVar(
            "NCCL_IB_PCI_RELAXED_ORDERING",
            "1",
            "PCIe relaxed ordering for InfiniBand inside the VM (NCCL >= 2.12); published "
            "25 GB/s disabled vs 188 GB/s enabled, 2 VMs x 8 GPUs",
            AZURE,
        ),
        EnvVar(
            "NCCL_TOPO_FILE",
            topo or "<the VM image's topology file>",
            "the VM hides the PCIe topology NCCL needs to pair GPUs with NICs"
            + ("" if topo else "; Azure HPC images ship one under /opt/microsoft"),
            AZURE,
        ),
        _tcp_common(snapshot, AZURE)[0],
    ]


def _azure_topo_file(snapshot: dict | None) -> str | None:
    import glob

    if snapshot is None:
        return None
    found = sorted(glob.glob("/opt/microsoft/*topo*.xml"))
    return found[0] if found else None


def render(name: str, variables: list[EnvVar]) -> str:
    """Shell text: one ``export`` per variable with its reason; advice lines as comments."""
    lines = [
        f"# commopt doctor --profile {name}: {PROFILES[name]}",
        '# eval "$(commopt doctor --profile NAME)" applies it; sources after each reason.',
    ]
    for v in variables:
        reason = f"{v.reason} [{v.source}]" if v.source else v.reason
        if v.value is None:
            lines.append(f"# {v.name}: {reason}")
        else:
            suffix = ":$LD_LIBRARY_PATH"  # kept unquoted so the shell expands it
            value = (
                shlex.quote(v.value[: -len(suffix)]) + suffix
                if v.value.endswith(suffix)
                else shlex.quote(v.value)
            )
            lines.append(f"export {v.name}={value}  # {reason}")
    return "\n".join(lines)
