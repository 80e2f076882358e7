"""Link rates: parse them the way `tc` spells them, and build the `tbf` qdisc that enforces one.

>>> parse_rate("1gbit")
1000000000
>>> parse_rate("100mbit")
100000000
>>> tbf_command("d0", 1_000_000_000)
'qdisc add dev d0 root tbf rate 1000000000bit burst 131072 latency 20ms'
"""

from __future__ import annotations

import re

# tc's units: "bit" suffixes are bits per second, "bps" suffixes are BYTES per second (tc(8)).
_BIT_UNITS = {
    "": 1,
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
}
_BYTE_UNITS = {
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")

# Shaping on this kind of machine stays faithful only while the CPUs can move the bytes;
# beyond this a "shaped" link measures the CPU, not the shaper.
FAITHFUL_LIMIT_BITS = 3 * 10**9


def parse_rate(text: str) -> int:
    """Bits per second from a tc-style rate: ``1gbit``, ``100mbit``, ``125mbps`` (bytes/s)."""
    m = _RATE.match(str(text).lower())
    unit = m.group(2) if m else None
    if m is None or (unit not in _BIT_UNITS and unit not in _BYTE_UNITS):
        raise ValueError(
            f"cannot read the link rate {text!r}: write it as tc does, e.g. 1gbit, 500mbit, "
            f"10gbit (bits per second) or 125mbps (bytes per second)"
        )
    bits = float(m.group(1)) * (_BIT_UNITS.get(unit) or _BYTE_UNITS[unit])
    if bits < 8 * 10**3:
        raise ValueError(f"link rate {text!r} is below 8 kbit/s: too slow to carry a job")
    return int(bits)


def format_rate(bits_per_s: float) -> str:
    """A rate for people: ``format_rate(1e9) == '1 Gbit/s'``."""
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {unit}"
    return f"{bits_per_s:.3g} bit/s"


def tbf_command(dev: str, bits_per_s: int) -> str:
    """The `tc -batch` line that limits ``dev``'s egress to ``bits_per_s``.

    The bucket holds about 1 ms of traffic (at least 64 KiB so one GSO super-packet fits;
    larger ones are split by tbf): small enough that a 0.1 s transfer sees the rate within
    about 1%. The queue holds 20 ms, so TCP keeps the link full without long drops.
    """
    burst = max(64 * 1024, bits_per_s // 8 // 1000)
    burst = 1 << (burst - 1).bit_length()  # a power of two reads well in `tc qdisc show`
    return f"qdisc add dev {dev} root tbf rate {bits_per_s}bit burst {burst} latency 20ms"
