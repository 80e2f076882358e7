"""MPI transport over mpi4py.

    $ commopt launch -n 2 -- python -c "
    import torch, commopt
    comm = commopt.create_communicator('mpi')
    t = torch.full((4,), float(comm.rank)); comm.allreduce(t); print(comm.rank, t.tolist())"

Threads: every operation of one communicator (collectives, object helpers, barrier, split)
runs on that communicator's single worker thread, in the order it was issued; the caller
waits on the returned Work (or at once for the synchronous forms). MPI is therefore called
from one thread per communicator, and a collective in flight overlaps the caller's
computation (mpi4py releases the GIL inside MPI). The public methods are safe to call from
several threads, but all ranks must issue operations in the same order.

Data: CPU tensors travel zero-copy through NumPy views. MPI has no 16-bit float type, so
fp16 and bf16 sums use a user-defined reduction that adds in fp32 and rounds to nearest
even once per pairwise addition: the wire still carries 16 bits. CUDA tensors are staged
through pinned host memory unless the MPI library reports CUDA support.

Between nodes (``pipeline="auto"``, the default, on a communicator whose ranks span several
nodes): allreduce, alltoall and allgather of at least ``pipeline_min_bytes`` run as
pipelined point-to-point transfers of segments no larger than the transport's eager limit
(a segmented ring reduce-scatter + allgather for allreduce, which also sums fp16/bf16 at
full speed with torch; direct pairwise exchanges for alltoall and allgather); smaller ones
run MPI's own nonblocking collectives. Both wait by polling with short sleeps, not by
spinning in MPI_Wait. With Open MPI's TCP transport (4.1) a large exchange otherwise often
carried its two directions one after the other (a rendezvous handshake waited behind the
other direction's bulk data), and spinning ranks took the cores that the peers and the
kernel's network processing needed: a 2-rank allreduce took about twice the link's time
(docs/benchmarks-allreduce.md). Eager-sized segments need no handshake, and keeping many in
flight fills both directions at once. ``pipeline="off"`` (or ``COMMOPT_MPI_PIPELINE=off``)
restores MPI's own blocking collectives everywhere; ``"on"`` uses the pipelined path within
a node too. Extra memory: one scratch buffer of 1/size of the largest allreduce.

A Python exception that escapes on any rank aborts the whole job (MPI_Abort) after its
traceback is printed, so the other ranks do not wait forever in a collective.

Modules: :mod:`~commopt.comm.mpi.transport` (the communicator), :mod:`~commopt.comm.mpi.p2p`
(ring and pairwise algorithms), :mod:`~commopt.comm.mpi.settings` (options and
environment), :mod:`~commopt.comm.mpi.user_ops` (16-bit sums),
:mod:`~commopt.comm.mpi.runtime` (lazy mpi4py, tensor views).
"""

from __future__ import annotations

from commopt.comm.mpi.p2p import direct_allgather, pairwise_alltoall, ring_allreduce
from commopt.comm.mpi.runtime import _mpi as _mpi  # the lazy mpi4py import other transports share
from commopt.comm.mpi.settings import (
    DEFAULT_PIPELINE_MIN_BYTES,
    OMPI_TCP_EAGER_DEFAULT,
    PIPELINE_ENV,
    PIPELINE_MIN_ENV,
    SEGMENT_ENV,
    default_segment_bytes,
    pipeline_settings,
    transfer_path,
)
from commopt.comm.mpi.transport import MPICommunicator

__all__ = [
    "DEFAULT_PIPELINE_MIN_BYTES",
    "OMPI_TCP_EAGER_DEFAULT",
    "PIPELINE_ENV",
    "PIPELINE_MIN_ENV",
    "SEGMENT_ENV",
    "MPICommunicator",
    "default_segment_bytes",
    "direct_allgather",
    "pairwise_alltoall",
    "pipeline_settings",
    "ring_allreduce",
    "transfer_path",
]
