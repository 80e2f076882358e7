"""Reading sizes people write: bytes with binary units, as nccl-tests and MPI options take them.

>>> parse_bytes("64K"), parse_bytes("1.5M"), parse_bytes("16MiB"), parse_bytes(4096)
(65536, 1572864, 16777216, 4096)
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: object, what: str | None = None) -> int:
    """Bytes from ``8``, ``64K``, ``1.5M``, ``16MiB`` or ``1G`` (binary units).

    ``what`` names the option in the error, which gives examples of what reads.
    """
    m = _SIZE.match(str(text))
    if m is None:
        where = f"{what}={text!r}" if what else f"the size {text!r}"
        raise ValueError(f"cannot read {where}: give a number of bytes, e.g. 65536, 64K, 16M or 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
