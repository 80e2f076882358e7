"""Findings about a machine's network set-up, from a snapshot (see ``probe.py``).

Each check is a pure function of the snapshot dict, so any machine can be described in a
test. The checks follow the published cloud practices for NCCL and MPI (see
docs/network-tuning.md for the numbers behind them).

    >>> from commopt.network.doctor import diagnose
    >>> snap = {
    ...     "env": {},
    ...     "interfaces": [
    ...         {"name": "eth0", "state": "up", "speed_mbps": 25000},
    ...         {"name": "eth1", "state": "up", "speed_mbps": 1000},
    ...     ],
    ... }
    >>> [(f.code, f.fix) for f in diagnose(snap)]
    [('nccl-socket-ifname', 'export NCCL_SOCKET_IFNAME=eth0')]

Snapshot keys read here (all optional): env, interfaces, rdma_devices, versions,
nccl_net_plugins, mca_params, virtualized.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from commopt.network import nccl_vars

# NCCL's socket transport limits (src/transport/net_socket.cc: MAX_THREADS, MAX_SOCKETS).
NCCL_MAX_SOCKET_THREADS = 16
NCCL_MAX_SOCKETS = 64
# Open MPI's default btl_tcp_if_exclude (loopback and PPP links).
OMPI_DEFAULT_TCP_EXCLUDE = "127.0.0.1/8,sppp"
# Interfaces NCCL itself skips when NCCL_SOCKET_IFNAME is unset.
NCCL_SKIPPED_PREFIXES = ("lo", "docker")
# Container bridges: same address on every host, so a transport that picks one hangs.
BRIDGE_PREFIXES = ("docker", "virbr", "br-", "veth", "cni", "flannel")

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    """One problem found: what it is, what to run to fix it, and where the advice comes from."""

    code: str
    severity: str  # error | warning | info
    message: str
    fix: str
    source: str

    def as_dict(self) -> dict:
        return asdict(self)


def diagnose(snapshot: dict) -> list[Finding]:
    """All findings for ``snapshot``, most severe first."""
    findings: list[Finding] = []
    for check in CHECKS:
        findings.extend(check(snapshot))
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


# -- helpers ----------------------------------------------------------------------------------
def _env(snap: dict) -> dict[str, str]:
    return snap.get("env") or {}


def _nccl_version(snap: dict) -> tuple[int, int, int] | None:
    v = (snap.get("versions") or {}).get("nccl")
    try:
        return nccl_vars.parse_version(v)
    except ValueError:
        return None


def candidate_interfaces(snap: dict) -> list[dict]:
    """Interfaces NCCL may pick on its own: up, not loopback, not skipped by NCCL."""
    out = []
    for itf in snap.get("interfaces") or []:
        name = itf.get("name", "")
        if itf.get("loopback") or name.startswith(NCCL_SKIPPED_PREFIXES):
            continue
        if itf.get("state", "up") not in ("up", "unknown"):
            continue
        out.append(itf)
    return out


def fastest_interface(snap: dict) -> str | None:
    """The candidate interface with the highest link speed (first one on a tie)."""
    cands = candidate_interfaces(snap)
    if not cands:
        return None
    return max(cands, key=lambda i: i.get("speed_mbps") or 0)["name"]


def nccl_ifname_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces selected by an NCCL_SOCKET_IFNAME value (prefixes, '^' excludes, '=' exact).

    >>> nccl_ifname_matches("^docker,lo", ["lo", "eth0", "docker0"])
    ['eth0']
    >>> nccl_ifname_matches("=eth0", ["eth0", "eth01"])
    ['eth0']
    """
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    body = body[1:] if exact else body
    items = [p for p in body.split(",") if p]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in items)

    return [n for n in names if hit(n) != exclude]


def _int(value: str | None, name: str) -> tuple[int | None, Finding | None]:
    if value is None:
        return None, None
    try:
        return int(value), None
    except ValueError:
        return None, Finding(
            "nccl-socket-limit",
            "error",
            f"{name}={value!r} is not an integer; NCCL ignores it.",
            f"export {name}=4",
            "NCCL docs: environment variables",
        )


# -- checks -----------------------------------------------------------------------------------
def check_socket_ifname(snap: dict) -> list[Finding]:
    """Several usable interfaces and NCCL_SOCKET_IFNAME unset (or matching nothing)."""
    env = _env(snap)
    cands = candidate_interfaces(snap)
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec is None:
        if len(cands) < 2:
            return []
        best = fastest_interface(snap)
        names = ", ".join(
            i["name"] + (f" ({i['speed_mbps']} Mbit/s)" if i.get("speed_mbps") else "")
            for i in cands
        )
        return [
            Finding(
                "nccl-socket-ifname",
                "warning",
                f"{len(cands)} network interfaces are up ({names}) and NCCL_SOCKET_IFNAME is unset: "
                "NCCL may carry traffic (or bootstrap) over the wrong one, or ranks may pick "
                "different ones and hang.",
                f"export NCCL_SOCKET_IFNAME={best}",
                "published: AWS TCP practice (set NCCL_SOCKET_IFNAME); NCCL docs",
            )
        ]
    all_names = [i.get("name", "") for i in snap.get("interfaces") or []]
    if all_names and not nccl_ifname_matches(spec, all_names):
        best = fastest_interface(snap) or "<interface>"
        return [
            Finding(
                "nccl-socket-ifname",
                "error",
                f"NCCL_SOCKET_IFNAME={spec!r} matches none of this machine's interfaces "
                f"({', '.join(all_names)}); NCCL will fail with 'no socket interface found'.",
                f"export NCCL_SOCKET_IFNAME={best}",
                "NCCL docs: NCCL_SOCKET_IFNAME",
            )
        ]
    return []


def _is_open_mpi(snap: dict) -> bool:
    mpi = (snap.get("versions") or {}).get("mpi") or ""
    return "open mpi" in mpi.lower() or "Open MPI" in (snap.get("launcher") or "")


def check_mpi_tcp_exclude(snap: dict) -> list[Finding]:
    """Open MPI's TCP transport would use lo or a container bridge (docker0)."""
    if not _is_open_mpi(snap):
        return []
    env, files = _env(snap), snap.get("mca_params") or {}
    include = env.get("OMPI_MCA_btl_tcp_if_include", files.get("btl_tcp_if_include"))
    if include:
        bad = [
            p
            for p in include.split(",")
            if p == "lo" or p.startswith("127.") or p.startswith(BRIDGE_PREFIXES)
        ]
        if not bad:
            return []
        return [
            Finding(
                "mpi-tcp-exclude",
                "warning",
                f"btl_tcp_if_include={include!r} lists {', '.join(bad)}: between nodes those "
                "addresses are not reachable (a bridge has the same address on every host).",
                "export OMPI_MCA_btl_tcp_if_include=<the data interface, e.g. eth0>",
                "published: AWS TCP practice (exclude lo,docker0 from MPI's TCP transport)",
            )
        ]
    exclude = env.get("OMPI_MCA_btl_tcp_if_exclude", files.get("btl_tcp_if_exclude"))
    user_set = exclude is not None
    items = [p.strip() for p in (exclude or OMPI_DEFAULT_TCP_EXCLUDE).split(",") if p.strip()]
    missing = []
    # Setting btl_tcp_if_exclude replaces Open MPI's default, which was what excluded loopback.
    if user_set and not any(p == "lo" or p.startswith("127.") for p in items):
        missing.append("lo")
    bridges = [
        i["name"]
        for i in snap.get("interfaces") or []
        if i.get("name", "").startswith(BRIDGE_PREFIXES)
    ]
    missing += [b for b in bridges if b not in items]
    if not missing:
        return []
    value = ",".join(dict.fromkeys(["lo", "docker0"] + [m for m in missing if m != "lo"]))
    return [
        Finding(
            "mpi-tcp-exclude",
            "warning",
            f"Open MPI's TCP transport does not exclude {', '.join(missing)}"
            + (f" (btl_tcp_if_exclude={exclude!r})" if user_set else "")
            + ": it may try to reach peers over loopback or a container bridge, which hangs or "
            "fails between nodes.",
            f"export OMPI_MCA_btl_tcp_if_exclude={value}",
            "published: AWS TCP practice (exclude lo,docker0 from MPI's TCP transport)",
        )
    ]


def check_socket_limit(snap: dict) -> list[Finding]:
    """NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD above NCCL's limits (16 threads, 64 sockets)."""
    env = _env(snap)
    nt, bad_nt = _int(env.get("NCCL_SOCKET_NTHREADS"), "NCCL_SOCKET_NTHREADS")
    ns, bad_ns = _int(env.get("NCCL_NSOCKS_PERTHREAD"), "NCCL_NSOCKS_PERTHREAD")
    out = [f for f in (bad_nt, bad_ns) if f]
    if nt is not None and nt > NCCL_MAX_SOCKET_THREADS:
        out.append(
            Finding(
                "nccl-socket-limit",
                "warning",
                f"NCCL_SOCKET_NTHREADS={nt} is above NCCL's maximum of {NCCL_MAX_SOCKET_THREADS}; "
                f"NCCL lowers it to {NCCL_MAX_SOCKET_THREADS}.",
                f"export NCCL_SOCKET_NTHREADS={NCCL_MAX_SOCKET_THREADS}",
                "NCCL source: net_socket.cc",
            )
        )
        nt = NCCL_MAX_SOCKET_THREADS
    if nt is not None and ns is not None and nt > 0 and ns > 0 and nt * ns > NCCL_MAX_SOCKETS:
        capped = NCCL_MAX_SOCKETS // nt
        out.append(
            Finding(
                "nccl-socket-limit",
                "warning",
                f"NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD = {nt} x {ns} = {nt * ns} sockets, above "
                f"NCCL's limit of {NCCL_MAX_SOCKETS}; NCCL lowers NCCL_NSOCKS_PERTHREAD to {capped}, so "
                "the setting you measured is not the one that runs.",
                f"export NCCL_NSOCKS_PERTHREAD={capped}",
                "NCCL docs (product of the two at most 64); NCCL source: net_socket.cc",
            )
        )
    return out


def _has_ofi_plugin(snap: dict) -> bool:
    plugins = snap.get("nccl_net_plugins") or []
    return (
        any("ofi" in p.lower() for p in plugins)
        or "ofi" in (_env(snap).get("NCCL_NET_PLUGIN") or "").lower()
    )


def check_efa(snap: dict) -> list[Finding]:
    """An EFA device without FI_PROVIDER=efa, or without the aws-ofi-nccl plugin."""
    efa = [d["name"] for d in snap.get("rdma_devices") or [] if d.get("kind") == "efa"]
    if not efa:
        return []
    out = []
    provider = _env(snap).get("FI_PROVIDER")
    if provider != "efa":
        now = f"FI_PROVIDER={provider!r}" if provider is not None else "FI_PROVIDER is unset"
        out.append(
            Finding(
                "efa-provider",
                "warning" if provider is None else "error",
                f"EFA device(s) {', '.join(efa)} present but {now}: libfabric may pick another "
                "provider; published: about 3x lower all-reduce bus bandwidth with FI_PROVIDER=tcp "
                "than with efa.",
                "export FI_PROVIDER=efa",
                "published: AWS EFA practice",
            )
        )
    if not _has_ofi_plugin(snap):
        out.append(
            Finding(
                "efa-ofi-plugin",
                "warning",
                f"EFA device(s) {', '.join(efa)} present but no aws-ofi-nccl plugin "
                "(libnccl-net*.so with 'ofi' in its path) on LD_LIBRARY_PATH or in the usual "
                "folders: NCCL will fall back to TCP sockets.",
                "install aws-ofi-nccl (the EFA installer ships it under /opt/amazon/ofi-nccl) and "
                "export LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:$LD_LIBRARY_PATH",
                "published: AWS EFA practice (libfabric + aws-ofi-nccl plugin)",
            )
        )
    return out


def _since(name: str) -> nccl_vars.Version:
    """The NCCL version that added ``name`` (the variables table records it)."""
    since = nccl_vars.NCCL_VARIABLES[name][0]
    if since is None:
        raise RuntimeError(f"commopt.network.nccl_vars has no first version for {name}: add it")
    return since


RELAXED_ORDERING_SINCE = _since("NCCL_IB_PCI_RELAXED_ORDERING")


def check_ib_in_vm(snap: dict) -> list[Finding]:
    """InfiniBand in a VM: relaxed ordering off, an NCCL too old for it, or no topology file."""
    ib = [d["name"] for d in snap.get("rdma_devices") or [] if d.get("kind") == "infiniband"]
    if not ib or not snap.get("virtualized"):
        return []
    env, out = _env(snap), []
    version = _nccl_version(snap)
    src = (
        "published: Azure InfiniBand VMs (25 vs 188 GB/s all-reduce bus bandwidth, 2 VMs x 8 GPUs)"
    )
    if version is not None and version < RELAXED_ORDERING_SINCE:
        out.append(
            Finding(
                "ib-relaxed-ordering",
                "warning",
                f"InfiniBand ({', '.join(ib)}) in a VM with NCCL {nccl_vars.format_version(version)}: "
                f"NCCL_IB_PCI_RELAXED_ORDERING needs NCCL >= "
                f"{nccl_vars.format_version(RELAXED_ORDERING_SINCE)}, so PCIe relaxed ordering stays off.",
                "upgrade NCCL (or PyTorch, which bundles it) to 2.12 or newer",
                src,
            )
        )
    elif env.get("NCCL_IB_PCI_RELAXED_ORDERING") == "0":
        out.append(
            Finding(
                "ib-relaxed-ordering",
                "warning",
                f"InfiniBand ({', '.join(ib)}) in a VM with NCCL_IB_PCI_RELAXED_ORDERING=0: relaxed "
                "ordering is off.",
                "export NCCL_IB_PCI_RELAXED_ORDERING=1",
                src,
            )
        )
    if "NCCL_TOPO_FILE" not in env:
        out.append(
            Finding(
                "ib-topo-file",
                "info",
                f"InfiniBand ({', '.join(ib)}) in a VM and NCCL_TOPO_FILE unset: a VM hides the PCIe "
                "topology NCCL uses to pair GPUs with NICs.",
                "export NCCL_TOPO_FILE=<the VM image's topology file, e.g. /opt/microsoft/ndv4-topo.xml>",
                "published: Azure InfiniBand VMs (NCCL_TOPO_FILE for the VM's topology)",
            )
        )
    return out


def check_nccl_variables(snap: dict) -> list[Finding]:
    """NCCL_* variables the installed NCCL does not read (too new, removed, misspelt)."""
    version = _nccl_version(snap)
    vname = nccl_vars.format_version(version)
    out = []
    for name in sorted(_env(snap)):
        if not name.startswith("NCCL_"):
            continue
        c = nccl_vars.check_variable(name, version)
        if c.kind == "too-new":
            out.append(
                Finding(
                    "nccl-unknown-variable",
                    "warning",
                    f"{name} is set but NCCL {vname} does not read it (added in "
                    f"{nccl_vars.format_version(c.version)}).",
                    f"upgrade NCCL to {nccl_vars.format_version(c.version)} or newer, or unset {name}",
                    "NCCL docs: environment variables",
                )
            )
        elif c.kind == "removed":
            out.append(
                Finding(
                    "nccl-unknown-variable",
                    "warning",
                    f"{name} is set but NCCL {vname} no longer reads it (not read since "
                    f"{nccl_vars.format_version(c.version)}).",
                    f"unset {name}",
                    "NCCL docs: environment variables",
                )
            )
        elif c.kind == "misspelt":
            out.append(
                Finding(
                    "nccl-unknown-variable",
                    "warning",
                    f"{name} is not an NCCL variable; did you mean {c.suggestion}?",
                    f"unset {name}; export {c.suggestion}=...",
                    "NCCL docs: environment variables",
                )
            )
        elif c.kind == "unrecognised":
            out.append(
                Finding(
                    "nccl-unknown-variable",
                    "info",
                    f"{name} is not in commopt's list of NCCL variables (the documented ones); "
                    "check its spelling, or ignore this if a plugin reads it.",
                    f"check {name} against the NCCL docs for version {vname}",
                    "NCCL docs: environment variables",
                )
            )
    return out


CHECKS = (
    check_socket_ifname,
    check_mpi_tcp_exclude,
    check_socket_limit,
    check_efa,
    check_ib_in_vm,
    check_nccl_variables,
)
