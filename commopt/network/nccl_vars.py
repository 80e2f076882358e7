"""Which environment variables NCCL reads, and from which version, as far as commopt knows.

The list holds the variables of NCCL's documentation (the "Environment Variables" pages of
the 2.4.8, 2.11.4 and 2.15.5 user guides) plus a few read in NCCL's source. A version is
given only where the documentation or the published practice states it; ``None`` means
"read by every NCCL 2 release commopt checks against" is NOT claimed, only that the variable
exists. Variables read by network plugins or by PyTorch are listed apart so they are not
reported as typos.

    >>> from commopt.network.nccl_vars import check_variable
    >>> check_variable("NCCL_IB_PCI_RELAXED_ORDERING", (2, 10, 3)).kind
    'too-new'
    >>> check_variable("NCCL_SOCKET_NTHREAD", (2, 21, 5)).suggestion
    'NCCL_SOCKET_NTHREADS'
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from packaging.version import InvalidVersion
from packaging.version import Version as PackagingVersion

Version = tuple[int, int, int]

# name -> (first version that reads it, first version that no longer reads it).
# Only versions we can stand behind are filled in; see the module docstring.
NCCL_VARIABLES: dict[str, tuple[Version | None, Version | None]] = {
    # sockets and interfaces
    "NCCL_SOCKET_IFNAME": (None, None),
    "NCCL_SOCKET_FAMILY": (None, None),
    "NCCL_SOCKET_NTHREADS": ((2, 4, 8), None),
    "NCCL_NSOCKS_PERTHREAD": ((2, 4, 8), None),
    # transports
    "NCCL_P2P_DISABLE": (None, None),
    "NCCL_P2P_LEVEL": ((2, 3, 4), None),
    "NCCL_P2P_DIRECT_DISABLE": (None, None),
    "NCCL_SHM_DISABLE": (None, None),
    "NCCL_NET": ((2, 10, 0), None),
    "NCCL_NET_PLUGIN": ((2, 11, 0), None),
    "NCCL_NET_GDR_LEVEL": (None, None),
    "NCCL_IB_GDR_LEVEL": (None, None),  # the former name of NCCL_NET_GDR_LEVEL
    "NCCL_NET_GDR_READ": (None, None),
    "NCCL_NET_SHARED_BUFFERS": (None, None),
    "NCCL_NET_SHARED_COMMS": (None, None),
    "NCCL_CROSS_NIC": (None, None),
    "NCCL_PXN_DISABLE": ((2, 12, 0), None),
    "NCCL_P2P_PXN_LEVEL": ((2, 12, 0), None),
    "NCCL_NVB_DISABLE": (None, None),
    "NCCL_NVLS_ENABLE": ((2, 17, 0), None),
    "NCCL_DMABUF_ENABLE": (None, None),
    "NCCL_COLLNET_ENABLE": (None, None),
    "NCCL_COLLNET_NODE_THRESHOLD": (None, None),
    # InfiniBand
    "NCCL_IB_DISABLE": (None, None),
    "NCCL_IB_HCA": (None, None),
    "NCCL_IB_TIMEOUT": (None, None),
    "NCCL_IB_RETRY_CNT": (None, None),
    "NCCL_IB_GID_INDEX": (None, None),
    "NCCL_IB_SL": (None, None),
    "NCCL_IB_TC": (None, None),
    "NCCL_IB_AR_THRESHOLD": (None, None),
    "NCCL_IB_CUDA_SUPPORT": (None, None),
    "NCCL_IB_QPS_PER_CONNECTION": (None, None),
    "NCCL_IB_PCI_RELAXED_ORDERING": ((2, 12, 0), None),
    # algorithms, protocols, sizes
    "NCCL_ALGO": ((2, 5, 0), None),
    "NCCL_PROTO": ((2, 5, 0), None),
    "NCCL_TREE_THRESHOLD": (None, (2, 5, 0)),  # replaced by the tuning model (NCCL_ALGO/PROTO)
    "NCCL_LL_THRESHOLD": (None, None),
    "NCCL_SINGLE_RING_THRESHOLD": (None, None),
    "NCCL_BUFFSIZE": (None, None),
    "NCCL_NTHREADS": (None, None),
    "NCCL_LL128_NTHREADS": (None, None),
    "NCCL_THREAD_THRESHOLDS": (None, None),
    "NCCL_MAX_NCHANNELS": (None, None),
    "NCCL_MIN_NCHANNELS": (None, None),
    "NCCL_MAX_NRINGS": (None, None),
    "NCCL_MIN_NRINGS": (None, None),
    "NCCL_RINGS": (None, None),
    "NCCL_P2P_NET_CHUNKSIZE": (None, None),
    "NCCL_P2P_LL_THRESHOLD": (None, None),
    "NCCL_ALLOC_P2P_NET_LL_BUFFERS": (None, None),
    # topology
    "NCCL_TOPO_FILE": (None, None),
    "NCCL_TOPO_DUMP_FILE": (None, None),
    "NCCL_IGNORE_CPU_AFFINITY": (None, None),
    # runtime behaviour and debugging
    "NCCL_DEBUG": (None, None),
    "NCCL_DEBUG_FILE": (None, None),
    "NCCL_DEBUG_SUBSYS": (None, None),
    "NCCL_CHECKS_DISABLE": (None, None),
    "NCCL_CHECK_POINTERS": (None, None),
    "NCCL_LAUNCH_MODE": (None, None),
    "NCCL_GRAPH_REGISTER": (None, None),
    "NCCL_GRAPH_MIXING_SUPPORT": (None, None),
    "NCCL_SET_STACK_SIZE": (None, None),
    "NCCL_SET_THREAD_NAME": (None, None),
    "NCCL_COMM_BLOCKING": (None, None),
    "NCCL_CONF_FILE": ((2, 23, 0), None),
}

# NCCL_-prefixed variables that PyTorch's ProcessGroupNCCL (not NCCL) reads; newer PyTorch
# spells them TORCH_NCCL_*.
TORCH_READS = {"NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT", "NCCL_DESYNC_DEBUG"}
# Prefixes of variables read by network plugins (Fast Socket, GPUDirect-TCPX, SHARP).
PLUGIN_PREFIXES = ("NCCL_FASTSOCKET_", "NCCL_GPUDIRECTTCPX_", "NCCL_SHARP_")


@dataclass(frozen=True)
class VariableCheck:
    """Outcome for one variable: kind is known, too-new, removed, misspelt or unrecognised."""

    name: str
    kind: str
    version: Version | None = None  # the since/removed version behind "too-new"/"removed"
    suggestion: str | None = None  # the close known name behind "misspelt"


def parse_version(text: str | tuple | None) -> Version | None:
    """'2.21.5' or (2, 21, 5) -> (2, 21, 5); None stays None (PEP 440 parsing by packaging).

    >>> parse_version("2.12"), parse_version("2.21.5+cuda12.4")
    ((2, 12, 0), (2, 21, 5))
    """
    if text is None:
        return None
    try:
        release = (
            tuple(int(p) for p in text)
            if isinstance(text, tuple)
            else PackagingVersion(str(text).strip()).release
        )
    except (InvalidVersion, ValueError, TypeError):
        raise ValueError(f"not a version: {text!r} (expected like '2.21.5')") from None
    return (release + (0, 0, 0))[:3]  # type: ignore[return-value]


def decode_nccl_version_code(code: int) -> Version:
    """ncclGetVersion's integer -> (major, minor, patch). 2.9 changed the encoding.

    >>> decode_nccl_version_code(22105), decode_nccl_version_code(2708)
    ((2, 21, 5), (2, 7, 8))
    """
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return (code // 10000, (code % 10000) // 100, code % 100)
    return (
        code // 1000,
        (code % 1000) // 100,
        code % 100,
    )  # before: major*1000 + minor*100 + patch


def format_version(v: Version | None) -> str:
    return "unknown" if v is None else ".".join(str(x) for x in v)


def check_variable(name: str, nccl_version: Version | None) -> VariableCheck:
    """Does NCCL ``nccl_version`` (None: unknown) read the variable ``name``?"""
    if name in TORCH_READS or name.startswith(PLUGIN_PREFIXES):
        return VariableCheck(name, "known")
    if name in NCCL_VARIABLES:
        since, removed = NCCL_VARIABLES[name]
        if nccl_version is not None and since is not None and nccl_version < since:
            return VariableCheck(name, "too-new", since)
        if nccl_version is not None and removed is not None and nccl_version >= removed:
            return VariableCheck(name, "removed", removed)
        return VariableCheck(name, "known")
    close = difflib.get_close_matches(name, list(NCCL_VARIABLES), n=1, cutoff=0.85)
    if close:
        return VariableCheck(name, "misspelt", suggestion=close[0])
    return VariableCheck(name, "unrecognised")
