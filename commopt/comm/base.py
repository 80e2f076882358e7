"""The Communicator contract every transport implements, and the pieces they share.

A communicator moves tensors between the ranks of one job. Every collective is called by
all ranks in the same order with tensors of the same size and dtype (``COMMOPT_DEBUG=1``
checks that before each call and names the ranks that disagree).

    >>> import torch, commopt
    >>> comm = commopt.create_communicator("local")
    >>> buf = torch.ones(4)
    >>> comm.allreduce(buf)  # sum in place; a world of one leaves it as it is
    >>> buf.tolist()
    [1.0, 1.0, 1.0, 1.0]
    >>> comm.allreduce(buf, async_op=True).wait()

Asynchronous forms return a :class:`Work`. After ``wait()`` returns (it re-raises any
error of the transport), the result is in the output tensor for everything the caller does
next: host-ordered transports (mpi, gloo, local) have finished, so the host may read it;
stream-ordered transports (``stream_ordered = True``: pure_nccl, torch with nccl) have
made the caller's *current CUDA stream* wait for the collective, so every kernel enqueued
afterwards on that stream sees the result while the host goes on at once. ``synchronize()``
blocks the host until the result is in memory, on every transport. Which thread or stream
runs the work is documented by each backend; all of them run a communicator's operations
in the order they were issued.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from commopt.comm.errors import CollectiveMismatchError, CommError

#: Environment variable that overrides the node (host) name, so tests and the emulated
#: cluster can fake several nodes on one machine.
NODE_NAME_ENV = "COMMOPT_NODE_NAME"
#: Environment variable that turns on the cross-rank argument checks.
DEBUG_ENV = "COMMOPT_DEBUG"

#: dtypes every communicator's ``allreduce`` sums correctly.
REDUCIBLE_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
)
#: dtypes a transport sums natively at full speed on the wire (``supports_sum``'s default).
NATIVE_SUM_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
#: gloo (torch >= 2.1) and NCCL (>= 2.10) sum fp16 and bf16 themselves too.
C10D_SUM_DTYPES = (*NATIVE_SUM_DTYPES, torch.float16, torch.bfloat16)


class Work:
    """Handle of an asynchronous operation (the contract: see this module's docstring)."""

    def wait(self) -> None:  # pragma: no cover - interface
        """The result is in place for what the caller does next (host, or its current stream)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the host until the result is in memory (``wait()`` where that already does)."""
        self.wait()

    def is_completed(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class CompletedWork(Work):
    """A Work that is already done (a world of one, or a synchronous fallback)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class FutureWork(Work):
    """A Work backed by a ``concurrent.futures.Future`` (thread-run backends)."""

    def __init__(self, future: Future, finalize: Callable[[], None] | None = None):
        self._future = future
        self._finalize = finalize

    def wait(self) -> None:
        self._future.result()
        if self._finalize is not None:
            finalize, self._finalize = self._finalize, None
            finalize()

    def is_completed(self) -> bool:
        return self._future.done()


class Communicator(ABC):
    """Base class of all transports. Subclasses implement the ``_``-prefixed primitives.

    Attributes: ``rank``, ``size``; ``intra_rank``/``intra_size`` (position among the ranks
    of the same node); ``inter_rank``/``inter_size`` (index of this node / number of
    nodes); ``allreduce_grad_dtype`` (the dtype gradients travel in by default, or None
    for their own dtype); ``name`` (the backend name given to ``create_communicator``).
    """

    name: str = "base"
    #: True when work is ordered by CUDA streams, issued inline by the calling thread
    #: (see :mod:`commopt.comm.streams`); False when a host thread completes it.
    stream_ordered: bool = False

    def __init__(self, *, allreduce_grad_dtype: torch.dtype | None = None):
        self.allreduce_grad_dtype = allreduce_grad_dtype
        self.debug = os.environ.get(DEBUG_ENV, "0") not in ("", "0", "false", "False")
        self.rank = 0
        self.size = 1
        self.intra_rank = 0
        self.intra_size = 1
        self.inter_rank = 0
        self.inter_size = 1
        self.node_name = node_name()
        # Communicators split off this one that it owns (see ``adopt``), finalized with it.
        self._owned: list[Communicator] = []
        self._owned_lock = threading.Lock()
        self._closed = False

    # -- topology -------------------------------------------------------------------
    def _init_topology(self) -> None:
        """Fill intra/inter ranks from every rank's node name (one small allgather)."""
        names = self.allgather_obj(self.node_name)
        nodes: list[str] = []
        for n in names:
            if n not in nodes:
                nodes.append(n)  # first-appearance order: node of rank 0 is node 0
        same = [r for r, n in enumerate(names) if n == self.node_name]
        self.intra_rank = same.index(self.rank)
        self.intra_size = len(same)
        self.inter_rank = nodes.index(self.node_name)
        self.inter_size = len(nodes)
        self.node_names = names

    # -- public collectives ------------------------------------------------------------
    def allreduce(self, buf: torch.Tensor, *, async_op: bool = False) -> Work | None:
        """Sum ``buf`` over all ranks, in place. fp32, fp64, fp16, bf16, int32, int64."""
        _check_contiguous(buf, "allreduce")
        if buf.dtype not in REDUCIBLE_DTYPES:
            raise TypeError(
                f"allreduce supports {', '.join(str(d) for d in REDUCIBLE_DTYPES)}; got {buf.dtype}"
            )
        self._debug_check("allreduce", buf)
        return self._result(self._allreduce(buf), async_op)

    def alltoall(
        self, send: torch.Tensor, recv: torch.Tensor, *, async_op: bool = False
    ) -> Work | None:
        """Chunk i of ``send`` (numel/size elements) goes to rank i; ``recv`` chunk j comes from rank j."""
        _check_contiguous(send, "alltoall send")
        _check_contiguous(recv, "alltoall recv")
        if send.numel() != recv.numel() or send.numel() % self.size:
            raise ValueError(
                f"alltoall needs send and recv of equal size divisible by the world size "
                f"{self.size}; got {send.numel()} and {recv.numel()} elements"
            )
        if send.dtype != recv.dtype:
            raise TypeError(f"alltoall send is {send.dtype} but recv is {recv.dtype}")
        self._debug_check("alltoall", send)
        return self._result(self._alltoall(send, recv), async_op)

    def allgather(
        self, send: torch.Tensor, recv: torch.Tensor, *, async_op: bool = False
    ) -> Work | None:
        """``recv`` (size x send.numel() elements) gets every rank's ``send``, in rank order."""
        _check_contiguous(send, "allgather send")
        _check_contiguous(recv, "allgather recv")
        if recv.numel() != send.numel() * self.size:
            raise ValueError(
                f"allgather needs recv of world size x send elements = {self.size} x "
                f"{send.numel()}; got {recv.numel()}"
            )
        if send.dtype != recv.dtype:
            raise TypeError(f"allgather send is {send.dtype} but recv is {recv.dtype}")
        self._debug_check("allgather", send)
        return self._result(self._allgather(send, recv), async_op)

    def broadcast(self, buf: torch.Tensor, root: int = 0, *, async_op: bool = False) -> Work | None:
        """Copy ``buf`` of rank ``root`` into ``buf`` of every rank."""
        _check_contiguous(buf, "broadcast")
        self._check_root(root)
        self._debug_check("broadcast", buf, root)
        return self._result(self._broadcast(buf, root), async_op)

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self._barrier()

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Broadcast ``obj`` from ``root``; returns it on every rank.

        ``obj`` is made of JSON values, tuples, bytes, tensors, NumPy arrays and dtypes; it
        travels as JSON plus raw bytes through this communicator's ``broadcast``, never as
        pickle (see commopt.comm.objects). Anything else raises ``TypeError``.
        """
        self._check_root(root)
        return self._bcast_obj(obj, root)

    def allgather_obj(self, obj: Any) -> list:
        """Every rank's ``obj`` (same kinds as ``bcast_obj``), as a list in rank order."""
        return self._allgather_obj(obj)

    def split(self, color: int, key: int | None = None) -> Communicator:
        """A communicator over the ranks that passed the same ``color``, ordered by ``key``."""
        return self._split(int(color), self.rank if key is None else int(key))

    def supports_sum(self, dtype: torch.dtype) -> bool:
        """True when the transport sums ``dtype`` natively at full speed on the wire.

        ``allreduce`` is correct for every dtype in REDUCIBLE_DTYPES; this tells the
        collectives whether a 16-bit buffer can be handed to it as it is, or whether
        accumulating in fp32 on the side (scatter-reduce/allgather) is the better plan.
        """
        return dtype in NATIVE_SUM_DTYPES

    def adopt(self, *subs: Communicator) -> None:
        """Make this communicator the owner of ``subs`` (communicators split off it).

        Its ``finalize()`` finalizes them, in the order adopted, before it releases its own
        resources: on the thread that calls ``finalize()``, in the same order on every rank
        (freeing an MPI communicator is collective). Adopting after ``finalize()`` finalizes
        ``subs`` at once and raises ``CommError``.
        """
        with self._owned_lock:
            closed = self._closed
            if not closed:
                self._owned.extend(subs)
        if closed:
            for sub in subs:
                sub.finalize()
            raise CommError(
                f"rank {self.rank}: this {self.name} communicator was finalized; the "
                f"communicators split off it were freed. Create a new communicator."
            )

    @property
    def finalized(self) -> bool:
        """Whether ``finalize()`` was called."""
        return self._closed

    def finalize(self) -> None:
        """Finalize the communicators this one owns (see ``adopt``), in the order adopted,
        then release this transport's resources (threads, streams). Safe to call twice."""
        with self._owned_lock:
            owned, self._owned = self._owned, []
            self._closed = True
        for sub in owned:
            sub.finalize()
        self._release()

    def _release(self) -> None:  # noqa: B027 - a default: most transports hold nothing to release
        """This transport's own resources (threads, streams, its MPI or NCCL communicator);
        called by ``finalize()``, possibly twice."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, size={self.size}, "
            f"node={self.inter_rank}/{self.inter_size}, local={self.intra_rank}/{self.intra_size})"
        )

    # -- backend primitives ----------------------------------------------------------
    # Each returns a Work (already completed for synchronous transports).
    @abstractmethod
    def _allreduce(self, buf: torch.Tensor) -> Work: ...

    @abstractmethod
    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work: ...

    @abstractmethod
    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work: ...

    @abstractmethod
    def _broadcast(self, buf: torch.Tensor, root: int) -> Work: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    # Objects travel as JSON + raw bytes over the tensor primitives above (no pickle). A
    # backend overrides these only to move the same bytes another way.
    def _bcast_obj(self, obj: Any, root: int) -> Any:
        from commopt.comm.objects import broadcast_object

        return broadcast_object(self, obj, root, send=self._broadcast)

    def _allgather_obj(self, obj: Any) -> list:
        from commopt.comm.objects import allgather_object

        return allgather_object(self, obj, gather=self._allgather)

    @abstractmethod
    def _split(self, color: int, key: int) -> Communicator: ...

    # -- helpers ----------------------------------------------------------------------
    @staticmethod
    def _result(work: Work, async_op: bool) -> Work | None:
        if async_op:
            return work
        work.wait()
        return None

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is not a rank of this communicator (size {self.size})")

    def _debug_check(self, op: str, buf: torch.Tensor, root: int | None = None) -> None:
        """With COMMOPT_DEBUG=1: all ranks must call the same op on the same size/dtype."""
        if not self.debug or self.size == 1:
            return
        mine = (op, int(buf.numel()), str(buf.dtype), root)
        everyone = self._allgather_obj(mine)
        if any(sig != everyone[0] for sig in everyone):
            groups: dict[tuple, list[int]] = {}
            for r, sig in enumerate(everyone):
                groups.setdefault(sig, []).append(r)
            detail = "; ".join(
                f"ranks {rs}: {sig[0]} of {sig[1]} x {sig[2]}"
                + (f" root {sig[3]}" if sig[3] is not None else "")
                for sig, rs in groups.items()
            )
            raise CollectiveMismatchError(
                f"rank {self.rank}: ranks disagree on the collective ({detail}). Every rank must "
                f"call the same collectives in the same order with tensors of the same size and dtype."
            )


def node_name() -> str:
    """This process's node: $COMMOPT_NODE_NAME if set, else the host name."""
    import socket

    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


def _check_contiguous(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: the tensor must be contiguous (call .contiguous() first)")


def scalar_device(comm: Communicator) -> torch.device:
    """Where ``comm``'s small tensors (flags, counts, a loss) must live.

    The current CUDA device for stream-ordered transports (NCCL moves device memory only),
    the CPU for the others.

        >>> import commopt
        >>> scalar_device(commopt.create_communicator("local"))
        device(type='cpu')
    """
    if comm.stream_ordered:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
