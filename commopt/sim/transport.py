"""How bytes cross between nodes: NCCL's transport, as flows and threads, not a pipe.

A :class:`Transport` caps what the inter-node link of a machine delivers to one collective:

- **sockets** (NCCL's socket transport, plain TCP): a peer connection is
  ``nthreads x nsocks_per_thread`` TCP flows; each flow is capped (``per_flow_gbps``: 10 Gbit/s
  on EC2) and each helper thread moves at most ``thread_GBps`` (its copy and system-call cost).
  NCCL cuts a request over its sockets in chunks of at least 64 KiB, so a small message uses
  fewer flows than there are sockets: the bandwidth depends on the message size.
- **ib-verbs** / **efa-libfabric**: RDMA; no per-flow cap. Inside a VM, PCIe relaxed ordering
  off (``relaxed_ordering=False``) leaves ``ro_off_fraction`` of the bandwidth.

``with_env`` applies NCCL variables (``NCCL_SOCKET_NTHREADS``, ``NCCL_NSOCKS_PERTHREAD``,
``NCCL_IB_PCI_RELAXED_ORDERING``, ``NCCL_NET_PLUGIN``) the way the transport's NCCL version
reads them; :func:`parse_nccl_env` reads ``"K=V K=V"`` or a ``commopt doctor`` profile name.

    >>> ec2 = TRANSPORTS["nccl-2.4-sockets-ec2"]
    >>> line = 25e9 / 8 * 0.956
    >>> round(ec2.cap_Bps(line, 64 * 2**20) * 8 / 1e9, 1)  # one flow: EC2's per-flow cap
    10.0
    >>> tuned = ec2.with_env(parse_nccl_env("NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4"))
    >>> round(tuned.cap_Bps(line, 64 * 2**20) * 8 / 1e9, 1)  # 16 flows: the NIC's line rate
    23.9
    >>> round(tuned.cap_Bps(line, 64 * 2**10) * 8 / 1e9, 1)  # a 64 KiB message uses one flow
    10.0
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace

KIB = 1024
MIB = 1024 * 1024
#: NCCL's socket transport splits a request over its sockets in pieces of at least this size
#: (net_socket.cc, MIN_CHUNKSIZE).
SOCKET_MIN_CHUNK = 64 * KIB
#: Data NCCL keeps in flight per connection and channel (default NCCL_BUFFSIZE, 4 MiB).
NCCL_BUFFSIZE = 4 * MIB
KINDS = ("sockets", "ib-verbs", "efa-libfabric", "host-tcp")


@dataclass(frozen=True)
class Transport:
    name: str
    kind: str  # one of KINDS
    nccl_version: str | None  # None: not NCCL (gloo, MPI)
    gdr: bool = False  # GPUDirect RDMA; False: staged through host memory
    relaxed_ordering: bool | None = None  # PCIe relaxed ordering (None: not applicable)
    ro_off_fraction: float = 1.0  # bandwidth kept with relaxed ordering off
    per_flow_gbps: float | None = None  # cap of one TCP flow
    thread_GBps: float | None = None  # what one socket helper thread moves
    nthreads: int = 1
    nsocks_per_thread: int = 1
    reads_socket_env: bool = False  # NCCL >= 2.4.8 reads NCCL_SOCKET_NTHREADS / NSOCKS
    plugin: str | None = None  # a network plugin in use ("fastsocket")
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"transport kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.nthreads < 1 or self.nsocks_per_thread < 1:
            raise ValueError(
                "NCCL_SOCKET_NTHREADS and NCCL_NSOCKS_PERTHREAD must be >= 1, got "
                f"{self.nthreads} and {self.nsocks_per_thread}"
            )
        if self.nthreads * self.nsocks_per_thread > 64:
            raise ValueError(
                f"NCCL allows at most 64 sockets per connection; "
                f"{self.nthreads} x {self.nsocks_per_thread} = {self.nthreads * self.nsocks_per_thread}"
            )
        if not 0 < self.ro_off_fraction <= 1:
            raise ValueError(f"ro_off_fraction must be in (0, 1], got {self.ro_off_fraction}")

    @property
    def flows(self) -> int:
        return self.nthreads * self.nsocks_per_thread if self.kind == "sockets" else 1

    def flows_used(self, message_bytes: float) -> int:
        """Flows that carry a message: one per 64 KiB piece, at most ``flows``."""
        if self.kind != "sockets":
            return 1
        inflight = min(max(message_bytes, 1.0), NCCL_BUFFSIZE)
        return max(1, min(self.flows, math.ceil(inflight / SOCKET_MIN_CHUNK)))

    def connection_Bps(self, message_bytes: float) -> float:
        """What one peer connection can move for a message (its flows and threads), before the
        NIC's own limit; infinite for RDMA transports."""
        caps = [math.inf]
        if self.kind in ("sockets", "host-tcp"):
            f = self.flows_used(message_bytes)
            if self.per_flow_gbps:
                caps.append(f * self.per_flow_gbps * 1e9 / 8)
            if self.thread_GBps:
                threads = min(self.nthreads, math.ceil(f / self.nsocks_per_thread))
                caps.append(threads * self.thread_GBps * 1e9)
        return min(caps)

    def cap_Bps(self, line_Bps: float, message_bytes: float, connections: int = 1) -> float:
        """Bytes/s a node moves for messages of ``message_bytes`` over ``connections`` peer
        connections at once, on a NIC that delivers ``line_Bps`` (line rate x protocol
        efficiency)."""
        bw = min(line_Bps, max(1, connections) * self.connection_Bps(message_bytes))
        if self.relaxed_ordering is False:
            bw *= self.ro_off_fraction
        return bw

    def with_env(self, env: dict[str, str]) -> Transport:
        """The transport as NCCL would run it with these variables set."""
        t = self
        for key, value in env.items():
            if key in ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"):
                if t.kind != "sockets" or not t.reads_socket_env:
                    continue  # RDMA transports and NCCL < 2.4.8 do not read them
                n = _positive_int(key, value)
                if key == "NCCL_SOCKET_NTHREADS":
                    t = replace(t, nthreads=n)
                else:
                    t = replace(t, nsocks_per_thread=n)
            elif key == "NCCL_IB_PCI_RELAXED_ORDERING":
                if t.relaxed_ordering is None or not _version_at_least(t.nccl_version, (2, 12)):
                    continue  # not a VM with the option, or NCCL < 2.12 does not read it
                t = replace(t, relaxed_ordering=value.strip() not in ("0",))
            elif key == "NCCL_NET_PLUGIN" or key == "COMMOPT_NET_PLUGIN":
                t = apply_plugin(t, value.strip())
        t.__post_init__()
        return t


def _positive_int(key: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{key} must be >= 1, got {n}")
    return n


def _version_at_least(version: str | None, minimum: tuple) -> bool:
    if version is None:
        return False
    parts = tuple(int(p) for p in version.split(".")[: len(minimum)] if p.isdigit())
    return parts >= minimum


# --- Google's NCCL Fast Socket -------------------------------------------------------------
#: Fast Socket's defaults (google/nccl-fastsocket, net_fastsocket.cc): flow placement is on
#: (NCCL_FLOW_PLACEMENT_ENABLE=1) with NCCL_NUM_FLOW_ENGINE=4 flow engines, and with flow
#: placement the plugin opens one socket per engine and one helper thread per socket
#: (ncclFlowPlacementGetNsockNthread: sockets = threads = engines). Zero-copy send is off by
#: default (NCCL_MIN_ZCOPY_SIZE=0), so each helper thread copies as NCCL's own socket threads do.
FASTSOCKET_FLOWS = 4
FASTSOCKET_THREADS = 4
FASTSOCKET_SOURCE = (
    "google/nccl-fastsocket net_fastsocket.cc defaults: flow placement on, 4 flow engines -> "
    "4 sockets served by 4 helper threads; zero-copy off (NCCL_MIN_ZCOPY_SIZE=0), so a thread "
    "copies as NCCL's socket threads do"
)


def apply_plugin(t: Transport, plugin: str) -> Transport:
    """A transport with a network plugin: ``fastsocket`` (GCP) replaces NCCL's sockets with its
    own: 4 sockets, one helper thread each (the plugin's defaults)."""
    if plugin in ("", "none"):
        return replace(t, plugin=None)
    if plugin != "fastsocket":
        raise ValueError(f"unknown network plugin {plugin!r}; the simulator knows 'fastsocket'")
    if t.kind != "sockets":
        raise ValueError(
            f"the fastsocket plugin replaces NCCL's socket transport; {t.name} uses {t.kind}"
        )
    return replace(
        t,
        name=t.name + "+fastsocket",
        plugin="fastsocket",
        nthreads=FASTSOCKET_THREADS,
        nsocks_per_thread=FASTSOCKET_FLOWS // FASTSOCKET_THREADS,
    )


def parse_nccl_env(text: str) -> dict[str, str]:
    """``"NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4"`` or a profile name of
    ``commopt doctor --profile`` (its variables with values) -> {name: value}.

        >>> parse_nccl_env("azure-ib")["NCCL_IB_PCI_RELAXED_ORDERING"]
        '1'
        >>> parse_nccl_env("gcp-fastsocket")
        {'NCCL_NET_PLUGIN': 'fastsocket'}

    Variables NCCL reads that the simulator does not model (NCCL_DEBUG, ...) are accepted and
    change nothing; a misspelt or unknown name is an error.
    """
    text = text.strip()
    if not text:
        return {}
    if "=" not in text:
        return profile_nccl_env(text)
    from commopt.network.nccl_vars import check_variable

    out = {}
    for word in shlex.split(text.replace(",", " ")):
        key, sep, value = word.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--nccl-env takes NAME=VALUE words or a profile name, got {word!r}")
        check = check_variable(key, None)
        if check.kind == "misspelt":
            raise ValueError(
                f"--nccl-env: NCCL does not read {key}; did you mean {check.suggestion}?"
            )
        if check.kind == "unrecognised" and key != "NCCL_NET_PLUGIN":
            raise ValueError(
                f"--nccl-env: {key} is not an NCCL variable commopt knows (commopt doctor "
                "lists them)"
            )
        out[key] = value.strip()
    return out


def profile_nccl_env(name: str) -> dict[str, str]:
    """The NCCL variables a ``commopt doctor`` profile sets (advice lines without a value are
    left out; the Fast Socket profile loads its plugin, which the simulator models)."""
    from commopt.network.cloud_profiles import PROFILES, profile_env

    if name not in PROFILES:
        raise ValueError(
            f"unknown --nccl-env profile {name!r}; give NAME=VALUE words or one of: "
            f"{', '.join(PROFILES)}"
        )
    out = {
        v.name: v.value
        for v in profile_env(name, None)
        if v.value is not None and v.name.startswith("NCCL_")
    }
    out.pop("NCCL_SOCKET_IFNAME", None)
    out.pop("NCCL_TOPO_FILE", None)
    if name == "gcp-fastsocket":
        out["NCCL_NET_PLUGIN"] = "fastsocket"
    return out


# --- presets --------------------------------------------------------------------------------

_EC2_FLOW = (
    "EC2 caps a single TCP flow at 10 Gbit/s (published; AWS EC2 instance network "
    "bandwidth documentation: single-flow limit inside a placement group)"
)
_NCCL_SOCKET_CHUNK = (
    "NCCL's socket transport (src/transport/net_socket.cc, MIN_CHUNKSIZE) splits a request "
    "across its sockets in pieces of max(64 KiB, size / sockets), handed to the helper threads "
    "round-robin"
)
_AUTO = (
    "NCCL's socket auto-detection (net_socket.cc, ncclSocketGetNsockNthread) picks 2 threads x 8 sockets "
    "only for AWS's NIC vendor id 0x1d0f; 1 x 1 otherwise"
)
_AUTO_GCP = (
    "later NCCL (src/transport/net_socket.cc, ncclNetSocketGetNsockNthread, NVIDIA/nccl commit 28189e2) "
    "also picks 4 threads x 1 socket for Google's gVNIC, vendor id 0x1ae0; the 2019 code (copyright "
    "2016-2019, commit 06abb3b) has the AWS branch only"
)
_THREAD_24 = (
    "one NCCL socket thread + stream reached about 60% of 32 Gbit/s, 19 Gbit/s = 2.4 GB/s, "
    "with NCCL 2.4 (NVIDIA/nccl#209, 2019)"
)
_THREAD_2018 = (
    "NCCL 2.x before 2.4: one socket per ring connection, staged through host memory; "
    "measured 600-800 MB/s per ring on 2x10 GbE with 4 GTX 1080 Ti per node, rising with "
    "NCCL_MIN_NRINGS=4 (horovod/horovod#743, 2019-01): 0.7 GB/s per connection"
)

TRANSPORTS: dict[str, Transport] = {}


def _reg(t: Transport) -> Transport:
    TRANSPORTS[t.name] = t
    return t


_reg(
    Transport(
        "nccl-2.2-sockets",
        "sockets",
        "2.2",
        gdr=False,
        thread_GBps=0.7,
        sources={
            "kind": "NCCL over TCP sockets (no InfiniBand); 2018-era NCCL 2.1/2.2",
            "thread_GBps": _THREAD_2018,
            "nthreads": "one socket per connection: NCCL < 2.4.8 has no "
            "NCCL_SOCKET_NTHREADS / NCCL_NSOCKS_PERTHREAD (NCCL 2.4.8 user guide)",
        },
    )
)
_reg(
    Transport(
        "nccl-2.2-sockets-ec2",
        "sockets",
        "2.2",
        gdr=False,
        thread_GBps=0.7,
        per_flow_gbps=10.0,
        sources={
            "kind": "NCCL over TCP on EC2 (ENA), 2018-era NCCL",
            "thread_GBps": _THREAD_2018,
            "per_flow_gbps": _EC2_FLOW,
        },
    )
)
_reg(
    Transport(
        "nccl-2.4-sockets-ec2",
        "sockets",
        "2.4.8",
        gdr=False,
        thread_GBps=2.4,
        per_flow_gbps=10.0,
        reads_socket_env=True,
        sources={
            "kind": "NCCL over TCP on EC2 (ENA), NCCL >= 2.4.8",
            "nthreads": (
                "1 thread x 1 socket: NCCL without the ENA auto-detection, the baseline of the published "
                "AWS measurement (setting 4 x 4 doubled its throughput, so its default had fewer flows; "
                "this reading of the note is the one thing the note informs); " + _AUTO
            ),
            "per_flow_gbps": _EC2_FLOW,
            "thread_GBps": _THREAD_24,
            "chunk": _NCCL_SOCKET_CHUNK,
        },
    )
)
_reg(
    Transport(
        "nccl-sockets-ec2-auto",
        "sockets",
        "2.4.8",
        gdr=False,
        thread_GBps=2.4,
        per_flow_gbps=10.0,
        nthreads=2,
        nsocks_per_thread=8,
        reads_socket_env=True,
        sources={
            "kind": "NCCL over TCP on EC2 (ENA) with NCCL's auto-detection: 2 threads x 8 sockets",
            "nthreads": _AUTO,
            "per_flow_gbps": _EC2_FLOW,
            "thread_GBps": _THREAD_24,
            "chunk": _NCCL_SOCKET_CHUNK,
        },
    )
)
_reg(
    Transport(
        "nccl-sockets-gcp",
        "sockets",
        "2.4.8",
        gdr=False,
        thread_GBps=2.4,
        per_flow_gbps=None,
        reads_socket_env=True,
        sources={
            "kind": "NCCL over TCP on Google Cloud (gVNIC), NCCL without the gVNIC auto-detection",
            "nthreads": "1 thread x 1 socket: " + _AUTO + "; " + _AUTO_GCP,
            "thread_GBps": _THREAD_24 + "; the single thread is the limit without Fast Socket",
            "per_flow_gbps": "assumption: no per-flow cap published for Google Cloud",
            "fastsocket": "NCCL Fast Socket: multiple flows with dynamic load balancing (published); "
            + FASTSOCKET_SOURCE,
            "chunk": _NCCL_SOCKET_CHUNK,
        },
    )
)
_reg(
    Transport(
        "nccl-sockets-gcp-auto",
        "sockets",
        "2.4.8",
        gdr=False,
        thread_GBps=2.4,
        per_flow_gbps=None,
        nthreads=4,
        nsocks_per_thread=1,
        reads_socket_env=True,
        sources={
            "kind": "NCCL over TCP on Google Cloud (gVNIC) with NCCL's gVNIC auto-detection: 4 threads x 1 socket",
            "nthreads": _AUTO_GCP,
            "thread_GBps": _THREAD_24,
            "per_flow_gbps": "assumption: no per-flow cap published for Google Cloud",
            "fastsocket": "NCCL Fast Socket: multiple flows with dynamic load balancing (published); "
            + FASTSOCKET_SOURCE,
            "chunk": _NCCL_SOCKET_CHUNK,
        },
    )
)
_reg(
    Transport(
        "nccl-sockets",
        "sockets",
        "2.10",
        gdr=False,
        thread_GBps=2.4,
        reads_socket_env=True,
        sources={
            "kind": "NCCL >= 2.4.8 over TCP on an on-premises Ethernet",
            "nthreads": "1 thread x 1 socket: " + _AUTO,
            "thread_GBps": _THREAD_24,
            "chunk": _NCCL_SOCKET_CHUNK,
        },
    )
)
_reg(
    Transport(
        "nccl-ib-gdr",
        "ib-verbs",
        "2.2",
        gdr=True,
        sources={"kind": "NCCL over InfiniBand verbs; RDMA, no per-flow cap"},
    )
)
_reg(
    Transport(
        "nccl-efa",
        "efa-libfabric",
        "2.4.8",
        gdr=False,
        sources={
            "kind": "NCCL over libfabric's EFA provider with the aws-ofi-nccl plugin (published)"
        },
    )
)
_reg(
    Transport(
        "nccl-2.12-ib-azure",
        "ib-verbs",
        "2.12",
        gdr=True,
        relaxed_ordering=True,
        ro_off_fraction=25 / 188,
        sources={
            "kind": "NCCL over InfiniBand inside an Azure VM (ATS), NCCL >= 2.12, relaxed ordering on",
            "ro_off_fraction": (
                "published all-reduce bus bandwidth, 2 VMs x 8 GPUs: 25 GB/s with PCIe "
                "relaxed ordering disabled vs 188 GB/s enabled; this row sets the "
                "parameter (in-sample only: no other source gives it)"
            ),
        },
    )
)
_reg(
    Transport(
        "gloo-tcp",
        "host-tcp",
        None,
        sources={"kind": "torch.distributed gloo over kernel TCP, one flow"},
    )
)
_reg(Transport("mpi-tcp", "host-tcp", None, sources={"kind": "Open MPI over kernel TCP, one flow"}))
