"""Where each chunk of a buffer goes: chunk bounds, the scatter-reduce pipeline's pieces,
and the per-chunk RNG streams and codec-state keys.

    >>> from commopt.collectives.layout import chunk_bounds
    >>> chunk_bounds(10, 3, 4)
    [(0, 4), (4, 8), (8, 10)]
"""

from __future__ import annotations

import math

from commopt.codecs.base import RngKey

__all__ = [
    "PHASE_GATHER",
    "PHASE_SCATTER",
    "PIECE_BYTES",
    "chunk_bounds",
    "chunk_rng",
    "elements_per_piece",
    "scatter_reduce_layout",
    "sub_key",
]

#: fp32 bytes per piece of the scatter-reduce pipeline: large enough that a transfer's
#: fixed cost is small against its wire time, small enough that the codec work of the
#: first and last piece (not hidden behind transfers) is a few milliseconds.
PIECE_BYTES = 4 << 20

# RNG stream layout: the caller's stream, then the phase, then the chunk index.
PHASE_SCATTER = 0
PHASE_GATHER = 1
_CHUNK_BITS = 24


def chunk_bounds(numel: int, parts: int, alignment: int = 1) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` chunks starting at multiples of ``alignment``.

    All chunks but the trailing ones have the same length; trailing chunks may be shorter
    or empty.

        >>> chunk_bounds(10, 3, 4)
        [(0, 4), (4, 8), (8, 10)]
        >>> chunk_bounds(5, 4, 4)
        [(0, 4), (4, 5), (5, 5), (5, 5)]
    """
    alignment = max(1, int(alignment))
    units = math.ceil(numel / alignment)
    width = math.ceil(units / parts) * alignment if units else 0
    return [(min(i * width, numel), min((i + 1) * width, numel)) for i in range(parts)]


def scatter_reduce_layout(
    numel: int, size: int, alignment: int = 1, piece_elems: int | None = None
) -> list[list[tuple[int, int]]]:
    """Pieces of the scatter-reduce pipeline, each a list of ``size`` chunks (rank j owns j).

    The buffer is cut into pieces of about ``piece_elems`` elements (one piece when None),
    each piece into one chunk per rank, every chunk starting at a multiple of ``alignment``:

        >>> scatter_reduce_layout(12, 2, 1, piece_elems=6)
        [[(0, 3), (3, 6)], [(6, 9), (9, 12)]]
        >>> scatter_reduce_layout(10, 2, 4, piece_elems=5)  # chunks start at multiples of 4
        [[(0, 4), (4, 8)], [(8, 10), (10, 10)]]
    """
    pieces = 1 if not piece_elems else max(1, math.ceil(numel / int(piece_elems)))
    bounds = chunk_bounds(numel, pieces * size, alignment)
    return [bounds[k * size : (k + 1) * size] for k in range(pieces)]


def elements_per_piece(piece_bytes: int | None, element_size: int) -> int | None:
    """Elements per piece of the scatter-reduce pipeline (None: the whole buffer is one piece)
    for ``piece_bytes`` (None: :data:`PIECE_BYTES`) of elements of ``element_size`` bytes.

        >>> elements_per_piece(None, 4) == PIECE_BYTES // 4, elements_per_piece(0, 4)
        (True, None)
    """
    piece = PIECE_BYTES if piece_bytes is None else int(piece_bytes)
    return max(1, piece // element_size) if piece > 0 else None


def chunk_rng(rng: RngKey | None, phase: int, index: int) -> RngKey | None:
    if rng is None:
        return None
    if index >> _CHUNK_BITS:
        raise ValueError(f"too many chunks for one allreduce ({index}); raise piece_bytes")
    stream = (rng.stream << (_CHUNK_BITS + 1)) | (phase << _CHUNK_BITS) | index
    return RngKey(rng.seed, rng.rank, rng.reduction, stream)


def sub_key(key: str | None, suffix: str) -> str | None:
    return None if key is None else f"{key}/{suffix}"
