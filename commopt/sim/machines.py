"""Machines: GPUs per node, the links between them, and presets with their public sources.

A machine has two levels. Inside a node every GPU has its own link (``intra``: NVLink or its
PCIe slot); without peer-to-peer access (GeForce cards) every transfer is staged through host
memory, so the GPUs behind one PCIe switch share its uplink (``uplink``, per direction), and
flows between switches are capped by ``cross_group``. Between nodes each node has one NIC
(``inter``), shared by all its GPUs. Every number of a preset comes with its source in
``sources``; "assumption" marks the few that no public figure pins down.

    >>> m = get_machine("v100-nvlink-25g")
    >>> m.gpus_per_node, round(m.inter.bandwidth_Bps * 8 / 1e9, 1)  # GPUs, TCP payload Gbit/s
    (8, 23.9)
    >>> m.transport.name, m.transport.flows  # NCCL sockets: 1 thread x 1 socket by default
    ('nccl-2.4-sockets-ec2', 1)
    >>> get_machine("v100-nvlink-25g").with_overrides(inter_gbps=100).inter_gbps
    100.0
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

from commopt.sim.costs import GBIT, GBYTE, Link
from commopt.sim.transport import TRANSPORTS, Transport

US = 1e-6
GLOO_LATENCY_US = 180.0  # see the testbed-1gbit-gloo preset


@dataclass(frozen=True)
class Machine:
    name: str
    description: str
    gpu: str  # key into a model profile's single-GPU throughput table
    gpus_per_node: int
    intra: Link  # each GPU's own link, one direction
    inter: Link  # each node's NIC, one direction (effective)
    inter_gbps: float  # the NIC's line rate (for display and overrides)
    inter_efficiency: float  # effective / line rate of the inter-node transport
    memory_GBps: float  # device memory bandwidth: sets default codec speeds
    p2p: bool = True
    group_size: int = 0  # GPUs behind one shared staged path (used when p2p is False)
    uplink: Link | None = None  # that shared path, one direction
    cross_group: Link | None = None  # cap of one flow between two groups (e.g. sockets)
    max_nodes: int | None = None
    message_overhead_s: float = 2 * 1e-6  # sender's cost per message of an all-to-all
    # Measured codec speeds on this machine's processor: (codec, encode GB/s, decode GB/s), in
    # GB/s of float32 input (the codec benchmark's unit); codecs not listed use the memory model.
    codec_GBps: tuple = ()
    # True where a worker's codec work runs on the processor that computes (a CPU worker with one
    # core, as on the testbed): codec seconds then add to the step instead of overlapping compute.
    # Transfers still overlap compute (the link is not the core). False: the codec has its own
    # hardware beside compute (GPU kernels on their own stream).
    codec_shares_compute_core: bool = False
    # How bytes cross between nodes (NCCL version, sockets / IB verbs / EFA, GDR, relaxed
    # ordering): caps ``inter`` per message (commopt.sim.transport). None: ``inter`` as it is.
    transport: Transport | None = None
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if int(self.gpus_per_node) != self.gpus_per_node or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive integer, got {self.gpus_per_node}")
        if not self.p2p and self.group_size and self.uplink is None:
            raise ValueError(f"machine {self.name!r}: group_size without p2p needs an uplink link")
        for entry in self.codec_GBps:
            if len(entry) != 3 or not (entry[1] > 0 and entry[2] > 0):
                raise ValueError(
                    f"machine {self.name!r}: codec_GBps entries are (codec, encode GB/s > 0, "
                    f"decode GB/s > 0), got {entry!r}"
                )

    def codec_speed(self, codec: str) -> tuple[float, float] | None:
        """(encode, decode) GB/s of float32 input measured for ``codec`` on this machine, or None."""
        for name, enc, dec in self.codec_GBps:
            if name == codec:
                return enc, dec
        return None

    def layout(self, gpus: int) -> tuple[int, int]:
        """(nodes, GPUs per node) for ``gpus`` workers, filling nodes first."""
        if int(gpus) != gpus or gpus < 1:
            raise ValueError(f"number of GPUs must be a positive integer, got {gpus}")
        if gpus <= self.gpus_per_node:
            return 1, int(gpus)
        if gpus % self.gpus_per_node:
            raise ValueError(
                f"{gpus} GPUs do not fill whole nodes of {self.gpus_per_node} on {self.name}; "
                f"use a multiple of {self.gpus_per_node} (or --gpus-per-node)"
            )
        nodes = gpus // self.gpus_per_node
        if self.max_nodes is not None and nodes > self.max_nodes:
            raise ValueError(
                f"{self.name} has at most {self.max_nodes} nodes "
                f"({self.max_nodes * self.gpus_per_node} GPUs); asked for {gpus} GPUs"
            )
        return nodes, self.gpus_per_node

    def with_overrides(
        self,
        *,
        inter_gbps: float | None = None,
        intra_GBps: float | None = None,
        gpus_per_node: int | None = None,
        inter_latency_us: float | None = None,
        transport: str | Transport | None = None,
        nccl_env: dict | None = None,
    ) -> Machine:
        """A copy with other link speeds, another transport, or NCCL variables applied to its
        transport; the preset's efficiencies are kept."""
        m = self
        if transport is not None:
            if isinstance(transport, str):
                if transport not in TRANSPORTS:
                    raise ValueError(
                        f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}"
                    )
                transport = TRANSPORTS[transport]
            m = replace(m, transport=transport, name=f"{m.name}[{transport.name}]")
        if nccl_env:
            if m.transport is None:
                raise ValueError(
                    f"machine {m.name!r} has no NCCL transport for --nccl-env to change"
                )
            t = m.transport.with_env(nccl_env)
            if t != m.transport:
                m = replace(m, transport=t, name=f"{m.name}+env")
        if inter_gbps is not None:
            if not inter_gbps > 0:
                raise ValueError(f"--inter-gbps must be > 0, got {inter_gbps}")
            bw = inter_gbps * GBIT * m.inter_efficiency
            m = replace(
                m,
                inter=Link(m.inter.latency_s, bw),
                inter_gbps=float(inter_gbps),
                name=f"{m.name}@{inter_gbps:g}G",
            )
        if inter_latency_us is not None:
            m = replace(m, inter=Link(inter_latency_us * US, m.inter.bandwidth_Bps))
        if intra_GBps is not None:
            if not intra_GBps > 0:
                raise ValueError(f"--intra-GBps must be > 0, got {intra_GBps}")
            m = replace(m, intra=Link(m.intra.latency_s, intra_GBps * GBYTE))
        if gpus_per_node is not None:
            m = replace(m, gpus_per_node=int(gpus_per_node), max_nodes=None)
        return m

    def to_dict(self) -> dict:
        def link(lk):
            return (
                None
                if lk is None
                else {"latency_us": lk.latency_s / US, "GBps": lk.bandwidth_Bps / GBYTE}
            )

        return {
            "name": self.name,
            "description": self.description,
            "gpu": self.gpu,
            "gpus_per_node": self.gpus_per_node,
            "max_nodes": self.max_nodes,
            "intra": link(self.intra),
            "inter": link(self.inter),
            "inter_gbps": self.inter_gbps,
            "inter_efficiency": self.inter_efficiency,
            "memory_GBps": self.memory_GBps,
            "p2p": self.p2p,
            "group_size": self.group_size,
            "uplink": link(self.uplink),
            "cross_group": link(self.cross_group),
            "message_overhead_us": self.message_overhead_s / US,
            "codec_GBps": {
                name: {"encode": enc, "decode": dec} for name, enc, dec in self.codec_GBps
            },
            "codec_shares_compute_core": self.codec_shares_compute_core,
            "transport": None
            if self.transport is None
            else {k: v for k, v in self.transport.__dict__.items() if k != "sources"},
            "sources": {
                **dict(self.sources),
                **(
                    {}
                    if self.transport is None
                    else {f"transport.{k}": v for k, v in self.transport.sources.items()}
                ),
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> Machine:
        """Inverse of :meth:`to_dict`; ``inter`` may instead be given as ``inter_gbps`` and
        ``inter_efficiency`` (default 0.9) with ``inter_latency_us``."""

        def link(v, what):
            if v is None:
                return None
            try:
                return Link(float(v["latency_us"]) * US, float(v["GBps"]) * GBYTE)
            except (KeyError, TypeError) as exc:
                raise ValueError(
                    f"machine {what} must be {{'latency_us': ..., 'GBps': ...}}, got {v!r}"
                ) from exc

        try:
            eff = float(d.get("inter_efficiency", 0.9))
            inter = link(d.get("inter"), "inter")
            gbps = d.get("inter_gbps")
            if inter is None:
                if gbps is None:
                    raise ValueError("machine needs 'inter' or 'inter_gbps'")
                inter = Link(float(d.get("inter_latency_us", 30.0)) * US, float(gbps) * GBIT * eff)
            if gbps is None:
                gbps = inter.bandwidth_Bps / GBIT / eff
            return cls(
                name=d["name"],
                description=d.get("description", ""),
                gpu=d["gpu"],
                gpus_per_node=int(d["gpus_per_node"]),
                intra=link(d["intra"], "intra"),
                inter=inter,
                inter_gbps=float(gbps),
                inter_efficiency=eff,
                memory_GBps=float(d.get("memory_GBps", 100.0)),
                p2p=bool(d.get("p2p", True)),
                group_size=int(d.get("group_size", 0)),
                uplink=link(d.get("uplink"), "uplink"),
                cross_group=link(d.get("cross_group"), "cross_group"),
                max_nodes=d.get("max_nodes"),
                message_overhead_s=float(d.get("message_overhead_us", 2.0)) * US,
                codec_GBps=_codec_speeds(d.get("codec_GBps", {})),
                codec_shares_compute_core=bool(d.get("codec_shares_compute_core", False)),
                transport=_transport(d.get("transport")),
                sources={
                    k: v
                    for k, v in dict(d.get("sources", {})).items()
                    if not k.startswith("transport.")
                },
            )
        except KeyError as exc:
            raise ValueError(f"machine description lacks the field {exc.args[0]!r}") from exc


def _transport(v) -> Transport | None:
    """A transport by preset name or as a dict of :class:`Transport` fields."""
    if v is None:
        return None
    if isinstance(v, str):
        if v not in TRANSPORTS:
            raise ValueError(f"unknown transport {v!r}; choose one of {', '.join(TRANSPORTS)}")
        return TRANSPORTS[v]
    try:
        return Transport(**v)
    except TypeError as exc:
        raise ValueError(
            f"machine transport must be a preset name or Transport fields: {exc}"
        ) from exc


def _codec_speeds(d) -> tuple:
    if not isinstance(d, dict):
        raise ValueError(
            f"machine codec_GBps must be {{codec: {{'encode': GB/s, 'decode': GB/s}}}}, got {d!r}"
        )
    try:
        return tuple((str(k), float(v["encode"]), float(v["decode"])) for k, v in d.items())
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"machine codec_GBps must be {{codec: {{'encode': GB/s, 'decode': GB/s}}}}, got {d!r}"
        ) from exc


# Shared facts, cited once. Every preset keeps the default message_overhead_s: assumption, 2 us
# of sender time per message of an all-to-all (LogP's o), the messages' latencies overlapping. Efficiencies: NCCL gets about 80% of NVLink line rate ("protocol
# overhead ~20%", NCCL maintainer, github.com/NVIDIA/nccl-tests/issues/212); we use the same
# factor for PCIe and for RDMA NICs.
NCCL_EFFICIENCY = 0.8
_NVLINK2 = (
    "NVLink 2.0: 25 GB/s per link per direction (V100 SXM2 datasheet: 6 links, 300 GB/s "
    "total); the ring is given one link per hop (GPU pairs of the hybrid cube-mesh have 1 "
    "or 2), times 0.8 NCCL protocol efficiency (NVIDIA/nccl-tests#212) = 20 GB/s"
)
_PCIE3 = "PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 = 15.75 GB/s per direction, x 0.8 = 12.6 GB/s"
_TCP1500 = (
    "TCP/IPv4 at MTU 1500 carries 1448 payload bytes per 1514-byte Ethernet frame: efficiency 0.956"
)


def _v100_nvlink(
    name: str,
    description: str,
    inter: Link,
    inter_gbps: float,
    inter_eff: float,
    inter_sources: dict,
) -> Machine:
    return Machine(
        name=name,
        description=description,
        gpu="v100",
        gpus_per_node=8,
        intra=Link(3 * US, 25 * GBYTE * NCCL_EFFICIENCY),
        inter=inter,
        inter_gbps=inter_gbps,
        inter_efficiency=inter_eff,
        memory_GBps=900.0,
        sources={
            "gpus_per_node": "8x V100 SXM2 per instance (AWS instance type specification)",
            "intra.bandwidth": _NVLINK2,
            "intra.latency": "assumption: 3 us per NCCL ring step over NVLink",
            "memory_GBps": "V100 SXM2 HBM2: 900 GB/s (datasheet)",
            **inter_sources,
        },
    )


PRESETS: dict[str, Machine] = {}


def _register(m: Machine) -> None:
    PRESETS[m.name] = m


_register(
    replace(
        _v100_nvlink(
            "v100-nvlink-25g",
            "AWS p3.16xlarge: 8x V100 (NVLink 2) per node, 25 Gbit/s TCP between nodes",
            inter=Link(30 * US, 25 * GBIT * 0.956),
            inter_gbps=25.0,
            inter_eff=0.956,
            inter_sources={
                "inter.bandwidth": (
                    "25 Gbit/s (p3.16xlarge network performance); " + _TCP1500 + "; what one "
                    "collective gets of it is set by the transport (flows x 10 Gbit/s per flow)"
                ),
                "inter.latency": "assumption: 30 us per message through the kernel TCP stack and ENA",
            },
        ),
        transport=TRANSPORTS["nccl-2.4-sockets-ec2"],
    )
)

_register(
    replace(
        _v100_nvlink(
            "p3dn-efa",
            "AWS p3dn.24xlarge: 8x V100 32 GB (NVLink 2), 100 Gbit/s EFA with aws-ofi-nccl",
            inter=Link(15 * US, 10 * GBYTE),
            inter_gbps=100.0,
            inter_eff=0.8,
            inter_sources={
                "inter.bandwidth": (
                    "EFA 100 Gbit/s; about 10 GB/s all-reduce bus bandwidth expected before "
                    "training (published), i.e. 0.8 of line rate"
                ),
                "inter.latency": "assumption: 15 us per message over EFA/SRD",
            },
        ),
        transport=TRANSPORTS["nccl-efa"],
    )
)

_register(
    replace(
        _v100_nvlink(
            "gcp-v100-100g",
            "Google Cloud n1 VM: 8x V100 (NVLink 2), gVNIC up to 100 Gbit/s, NCCL over TCP",
            inter=Link(30 * US, 100 * GBIT * 0.956),
            inter_gbps=100.0,
            inter_eff=0.956,
            inter_sources={
                "inter.bandwidth": "gVNIC up to 100 Gbit/s (published); " + _TCP1500,
                "inter.latency": "assumption: 30 us per message through the kernel TCP stack",
                "gpus_per_node": "8x V100 per VM, 8 VMs for 64 GPUs (published Fast Socket BERT-Large run)",
            },
        ),
        transport=TRANSPORTS["nccl-sockets-gcp"],
    )
)

_register(
    Machine(
        name="azure-ndv4",
        description="Azure ND A100 v4: 8x A100 (NVLink 3), 8x HDR InfiniBand 200 Gbit/s per VM",
        gpu="a100",
        gpus_per_node=8,
        intra=Link(3 * US, 300 * GBYTE * NCCL_EFFICIENCY),
        inter=Link(5 * US, 8 * 200 * 64 / 66 * GBIT * NCCL_EFFICIENCY),
        inter_gbps=1600.0,
        inter_efficiency=64 / 66 * NCCL_EFFICIENCY,
        memory_GBps=1555.0,
        transport=TRANSPORTS["nccl-2.12-ib-azure"],
        sources={
            "gpus_per_node": "8x A100 40 GB SXM4 per ND A100 v4 VM (Azure VM size specification)",
            "intra.bandwidth": (
                "NVLink 3: 12 links x 25 GB/s per direction = 300 GB/s (A100 datasheet: "
                "600 GB/s total), x 0.8 NCCL protocol efficiency (NVIDIA/nccl-tests#212)"
            ),
            "intra.latency": "assumption: 3 us per NCCL ring step over NVLink",
            "inter.bandwidth": (
                "8 HDR InfiniBand NICs of 200 Gbit/s per VM (Azure VM size specification), "
                "x 64/66 encoding x 0.8 NCCL efficiency"
            ),
            "inter.latency": "assumption: 5 us per message over InfiniBand inside a VM",
            "memory_GBps": "A100 40 GB HBM2: 1555 GB/s (datasheet)",
        },
    )
)

_register(
    Machine(
        name="rtx3090-pcie",
        description="8x RTX 3090 on PCIe 3.0 switches (4 per switch, 2 sockets), no peer-to-peer",
        gpu="rtx3090",
        gpus_per_node=8,
        p2p=False,
        group_size=4,
        intra=Link(15 * US, 15.75 * GBYTE * NCCL_EFFICIENCY),
        uplink=Link(15 * US, 6.1 * GBYTE),
        cross_group=Link(15 * US, 4.3 * GBYTE),
        inter=Link(30 * US, 10 * GBIT * 0.956),
        inter_gbps=10.0,
        inter_efficiency=0.956,
        memory_GBps=936.0,
        transport=TRANSPORTS["nccl-sockets"],
        sources={
            "p2p": "GeForce cards have no PCIe peer-to-peer: NCCL stages every transfer through host memory",
            "intra.bandwidth": _PCIE3 + " (the GPU's own slot; not the bottleneck here)",
            "group_size": (
                "assumption: 4 GPUs behind each PCIe switch, one switch per socket (the usual "
                "8-GPU 4U layout; the server of NVIDIA/nccl#1127 has its GPUs in two groups of 4)"
            ),
            "uplink": (
                "6.1 GB/s per direction through a switch shared by the staged copies: "
                "p2pBandwidthLatencyTest on an 8x RTX 3090 PCIe 3.0 x16 server without P2P gives "
                "6.1 GB/s bidirectional for two GPUs behind the same switch (NVIDIA/nccl#1127)"
            ),
            "cross_group": "same measurement: 8.6 GB/s bidirectional between switches, 4.3 GB/s per flow",
            "intra.latency": "same measurement: 12-17 us latency without P2P",
            "inter": "not part of the published set-up (one server); 10 GbE assumed for what-if runs",
            "memory_GBps": "RTX 3090 GDDR6X: 936 GB/s (specification)",
        },
    )
)

_P100_SOURCES = {
    "gpus_per_node": "8 P100 per node, up to 4 nodes (published ChainerMN experiment)",
    "intra.bandwidth": "P100 PCIe with peer-to-peer; " + _PCIE3,
    "intra.latency": "assumption: 10 us per step over PCIe peer-to-peer",
    "memory_GBps": "P100 PCIe 16 GB HBM2: 732 GB/s (datasheet)",
}
_register(
    Machine(
        name="p100-10gbe",
        description="8x P100 (PCIe) per node, 10 Gbit/s Ethernet between nodes",
        gpu="p100",
        gpus_per_node=8,
        intra=Link(10 * US, 15.75 * GBYTE * NCCL_EFFICIENCY),
        inter=Link(30 * US, 10 * GBIT * 0.956),
        inter_gbps=10.0,
        inter_efficiency=0.956,
        memory_GBps=732.0,
        transport=TRANSPORTS["nccl-2.2-sockets"],
        sources={
            **_P100_SOURCES,
            "inter.bandwidth": "10 GbE; " + _TCP1500,
            "inter.latency": "assumption: 30 us per message over kernel TCP",
        },
    )
)
_register(
    Machine(
        name="p100-ib-fdr",
        description="8x P100 (PCIe) per node, InfiniBand FDR 4x between nodes",
        gpu="p100",
        gpus_per_node=8,
        intra=Link(10 * US, 15.75 * GBYTE * NCCL_EFFICIENCY),
        inter=Link(2 * US, 54.54 * GBIT * NCCL_EFFICIENCY),
        inter_gbps=54.54,
        inter_efficiency=NCCL_EFFICIENCY,
        memory_GBps=732.0,
        transport=TRANSPORTS["nccl-ib-gdr"],
        sources={
            **_P100_SOURCES,
            "inter.bandwidth": (
                "InfiniBand FDR 4x: 14.0625 Gbit/s x 4 lanes x 64/66 = 54.54 Gbit/s data "
                "rate, x 0.8 NCCL efficiency"
            ),
            "inter.latency": "assumption: 2 us per message over InfiniBand verbs",
        },
    )
)

# The testbed's processor: one core per emulated host. Codec speeds from the codec benchmark
# on an idle machine (the scatter-reduce's codec work runs on the same core as the transport).
_TESTBED_CODECS = (("qsgd4", 6.74, 11.3), ("qsgd8", 7.3, 22.0))
_TESTBED_CODEC_SOURCE = (
    "benchmarks/codec_perf.py --mib 48 (one core, idle machine, 2026-11-21): QSGD bucket 128, max "
    "scale, stochastic rounding (commopt's default): qsgd4 encode 6.74 / decode 11.3 GB/s, qsgd8 "
    "7.3 / 22 GB/s of float32 input (memcpy of the same buffer: about 17 GB/s)"
)


def _testbed(name: str, transport: str, latency_us: float, latency_source: str) -> Machine:
    return Machine(
        name=name,
        description=(
            f"this project's emulated cluster: 2 hosts (network namespaces), 1 worker each, "
            f"1 Gbit/s, {transport}"
        ),
        gpu="cpu",
        gpus_per_node=1,
        max_nodes=None,
        intra=Link(1 * US, 10 * GBYTE),
        inter=Link(latency_us * US, 1 * GBIT * 0.956),
        inter_gbps=1.0,
        inter_efficiency=0.956,
        memory_GBps=10.0,
        codec_GBps=_TESTBED_CODECS,
        codec_shares_compute_core=True,
        sources={
            "inter.bandwidth": "1 Gbit/s shaped link (the testbed's target); " + _TCP1500,
            "inter.latency": latency_source,
            "intra": "unused: one worker per host",
            "codec_GBps": _TESTBED_CODEC_SOURCE,
            "codec_shares_compute_core": (
                "the 2 emulated hosts share the machine's 2 cores, one rank each with 1 torch thread: a "
                "rank's compute, its codec work and its transport's CPU work take turns on one core, and "
                "the step benchmark's compute time is measured under the same sharing"
            ),
            "memory_GBps": (
                "assumption: 10 GB/s streamed by one CPU core (sets the speed of the codecs "
                "without a measured entry: the fp16/bf16 casts)"
            ),
        },
    )


_register(
    _testbed(
        "testbed-1gbit",
        "commopt's mpi communicator",
        50.0,
        "assumption: 50 us per collective (per message of a ring step or an all-to-all phase) through veth "
        "pairs and the kernel TCP stack; consistent with the pipelined qsgd4 allreduce of 64 MiB on the mpi "
        "communicator on a quiet machine (77.6 ms measured on 2026-11-21; the model gives 77.4 ms, of which "
        "1.7 ms are the 32 collectives' latencies)",
    )
)
_register(
    _testbed(
        "testbed-1gbit-gloo",
        "torch.distributed (gloo)",
        GLOO_LATENCY_US,
        "measured: a pipelined qsgd4 allreduce of 96 MiB (24 pieces, 48 collectives) on gloo took 122 ms "
        "on a quiet machine (2026-11-21), 9 ms more than the pipeline's transfers and codec work at the "
        "link rate; spread over its 48 collectives: about 180 us each (a row outside the validation set, "
        "which has 16 and 64 MiB)",
    )
)


def list_machines() -> list[str]:
    return sorted(PRESETS)


def get_machine(name_or_path: str | Machine) -> Machine:
    """A preset by name, or a machine described in a JSON file (see :meth:`Machine.from_dict`)."""
    if isinstance(name_or_path, Machine):
        return name_or_path
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json") or os.path.sep in name_or_path:
        if not os.path.exists(name_or_path):
            raise FileNotFoundError(f"machine file {name_or_path!r} does not exist")
        with open(name_or_path) as f:
            return Machine.from_dict(json.load(f))
    raise ValueError(
        f"unknown machine {name_or_path!r}; presets: {', '.join(list_machines())} "
        "(or give a JSON file)"
    )
