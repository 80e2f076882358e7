"""Where the ranks of a communicator live: node layout and the intra/inter-node split.

    >>> import commopt
    >>> from commopt.comm import topology
    >>> comm = commopt.create_communicator("local")
    >>> topology.uniform_nodes(comm)
    True
    >>> intra, inter = topology.hierarchy(comm)
    >>> (intra.size, inter.size)
    (1, 1)

The (intra, inter) pair of a communicator is built once (two collective ``comm.split``
calls) and cached here, weakly keyed by the communicator: the split communicators live as
long as the one they came from.
"""

from __future__ import annotations

import threading
import weakref

from commopt.comm.base import Communicator

__all__ = ["hierarchy", "uniform_nodes"]

_HIERARCHY: weakref.WeakKeyDictionary[Communicator, tuple[Communicator, Communicator]] = (
    weakref.WeakKeyDictionary()
)
_HIERARCHY_LOCK = threading.Lock()


def uniform_nodes(comm: Communicator) -> bool:
    """Whether every node holds the same number of ``comm``'s ranks (known node names)."""
    names = getattr(comm, "node_names", None)
    if not names or len(names) != comm.size:
        return False
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return len(set(counts.values())) == 1


def hierarchy(comm: Communicator) -> tuple[Communicator, Communicator]:
    """(intra-node, inter-node) communicators of ``comm``, built once and cached.

    A collective call on first use: every rank must reach it in the same order (the
    collectives call it from their worker thread, in issue order).
    """
    with _HIERARCHY_LOCK:
        pair = _HIERARCHY.get(comm)
        if pair is None:
            # Both splits are collective over ``comm``: same order on every rank.
            intra = comm.split(comm.inter_rank, comm.intra_rank)
            inter = comm.split(comm.intra_rank, comm.inter_rank)
            pair = _HIERARCHY[comm] = (intra, inter)
        return pair
