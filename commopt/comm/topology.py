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
calls) and cached here, weakly keyed by the communicator. The communicator owns the pair
(``Communicator.adopt``): its ``finalize()`` finalizes both first, then itself.

    >>> comm.finalize()
    >>> intra.finalized, inter.finalized
    (True, True)
"""

from __future__ import annotations

import threading
import weakref

from commopt.comm.base import Communicator
from commopt.comm.errors import CommError

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
    collectives call it from their worker thread, in issue order). ``comm`` owns the pair:
    ``comm.finalize()`` finalizes it. A finalized ``comm`` has none: ``CommError``.
    """
    with _HIERARCHY_LOCK:
        if comm.finalized:
            raise CommError(
                f"rank {comm.rank}: hierarchy() of a finalized {comm.name} communicator; "
                f"create a new communicator"
            )
        pair = _HIERARCHY.get(comm)
        if pair is None:
            # Both splits are collective over ``comm``: same order on every rank.
            intra = comm.split(comm.inter_rank, comm.intra_rank)
            inter = comm.split(comm.intra_rank, comm.inter_rank)
            # Finalized with ``comm``, by its finalize(), intra first (raises if ``comm`` was
            # finalized meanwhile, after freeing both).
            comm.adopt(intra, inter)
            pair = _HIERARCHY[comm] = (intra, inter)
        return pair
