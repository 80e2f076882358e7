"""Measure what a link of an emulated cluster really carries.

    >>> with emulated_cluster(2, "1gbit") as cluster:  # doctest: +SKIP
    ...     print(format_rate(measure_link(cluster, 0, 1)))
    955 Mbit/s

The figure is TCP goodput: payload bits over the time from first to last byte. On a shaped
Ethernet-like link it sits a few percent under the link rate (headers take 66 of every 1514
bytes at MTU 1500, so the ceiling is about 95.6%).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from commopt.testbed.netns import EmulatedCluster

PROBE = Path(__file__).with_name("linkprobe.py")
PROBE_PORT = 5201


def measure_link(
    cluster: EmulatedCluster,
    src: int = 0,
    dst: int = 1,
    nbytes: int = 32 * 2**20,
    timeout: float = 60,
) -> float:
    """Bits per second of TCP payload sent from host ``src`` to host ``dst``."""
    if src == dst:
        raise ValueError("measure_link needs two different hosts")
    dst_host = cluster.hosts[dst]
    recv = subprocess.Popen(
        cluster.host_argv(
            dst, [sys.executable, str(PROBE), "recv", dst_host.data_ip, str(PROBE_PORT)]
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        sent = subprocess.run(
            cluster.host_argv(
                src,
                [
                    sys.executable,
                    str(PROBE),
                    "send",
                    dst_host.data_ip,
                    str(PROBE_PORT),
                    str(nbytes),
                ],
            ),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if sent.returncode != 0:
            raise RuntimeError(f"link probe sender failed: {sent.stderr.strip()}")
        out, err = recv.communicate(timeout=timeout)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    if recv.returncode != 0:
        raise RuntimeError(f"link probe receiver failed: {err.strip()}")
    result = json.loads(out)
    if result["bytes"] != nbytes:
        raise RuntimeError(f"link probe received {result['bytes']} of {nbytes} bytes")
    return result["bytes"] * 8 / result["seconds"]
