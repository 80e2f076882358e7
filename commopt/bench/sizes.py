"""Message-size sweeps written the nccl-tests way: ``-b 8 -e 128M -f 2``.

>>> parse_size("128M"), parse_size("4k"), parse_size("1G")
(134217728, 4096, 1073741824)
>>> sizes(1024, 8192, factor=2)
[1024, 2048, 4096, 8192]
>>> sizes(1024, 4096, increment=1024)
[1024, 2048, 3072, 4096]
"""

from __future__ import annotations

from commopt.units import parse_bytes


def parse_size(text: str) -> int:
    """Bytes from ``8``, ``64K``, ``16M``, ``1G`` (binary units, as nccl-tests reads them)."""
    return parse_bytes(text)


def sizes(begin: int, end: int, *, factor: int = 2, increment: int = 0) -> list[int]:
    """Sizes from ``begin`` to ``end`` inclusive: times ``factor``, or plus ``increment``."""
    if begin <= 0 or end < begin:
        raise ValueError(f"the sweep needs 0 < begin <= end, got -b {begin} -e {end}")
    if increment < 0 or (increment == 0 and factor < 2 and end > begin):
        raise ValueError("a sweep needs -f FACTOR >= 2 or -i INCREMENT > 0")
    out, size = [], begin
    while size <= end:
        out.append(size)
        if size == end:
            break
        size = size + increment if increment else size * factor
    return out
