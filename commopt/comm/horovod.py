"""Horovod transport over ``horovod.torch`` (``make horovod`` builds it for this machine).

    $ mpirun -np 2 python -c "
    import torch, commopt
    comm = commopt.create_communicator('horovod')
    t = torch.full((4,), float(comm.rank)); comm.allreduce(t); print(comm.rank, t.tolist())"

It also runs under ``horovodrun -np 2 python train.py``. Horovod's background thread
carries every operation; the asynchronous forms return a Work around Horovod's handle
(``wait`` is ``hvd.synchronize``, ``is_completed`` is ``hvd.poll``).

Names: every operation gets a name from its communicator and a per-communicator counter, so
Horovod matches the same call on every rank even when sub-communicators (process sets) run
different numbers of operations.

Data types: Horovod 0.28 sums fp32, fp64, fp16, int32 and int64. It has no bfloat16, so a
bf16 ``allreduce`` is summed in fp32 and rounded once at the end (twice the bytes on the
wire; ``supports_sum(torch.bfloat16)`` is False so commopt's collectives move bf16 wires
with alltoall/allgather and accumulate in fp32 themselves). Data movement (alltoall,
allgather, broadcast) of bf16 travels as raw 16-bit words.

A rank that leaves early (``sys.exit``, an early return, an exception) under Horovod over
MPI is named by its peers: see :mod:`commopt.comm.horovod_exit`.

Bounded waits: each operation's ``wait`` (``barrier`` is a one-element allreduce) polls it and
raises ``CommError`` a timeout after its issue. Starting an operation runs under a native deadline
(:mod:`commopt.comm.deadline`): Horovod's start functions hold the GIL while they wait for a
lock its background thread keeps through a blocking MPI exchange (process sets on), so once
a link is down they freeze every Python thread; the deadline's native thread still ends the
process, naming the peers, a timeout later.

``split`` registers Horovod process sets, which every rank of the job must do together:
split the top-level communicator (all ranks call it), not a communicator made by split.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from commopt.comm import horovod_exit
from commopt.comm.base import Communicator, CompletedWork, Work
from commopt.comm.deadline import deadline
from commopt.comm.errors import CommError
from commopt.comm.timeout import COMM_TIMEOUT_ENV, comm_timeout

_DONE = CompletedWork()
_OWNS_INIT = False  # True when this module called hvd.init() (and so may shut it down)
_PROCESS_SETS: dict[tuple[int, ...], Any] = {}  # ranks -> hvd.ProcessSet, registered once


def _hvd(timeout_s: float = math.inf):
    """Import horovod.torch lazily and initialise it; a missing build says how to get one.

    Horovod reads its stall settings at init: unless set already, a stall (a rank missing
    from an operation the others started) is reported after half the communication
    timeout (at most 60 s) and shuts Horovod down after the timeout
    (HOROVOD_STALL_CHECK_TIME_SECONDS, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).
    """
    global _OWNS_INIT
    try:
        import horovod.torch as hvd
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the 'horovod' communicator needs Horovod built with PyTorch support: run "
            "'make horovod' (builds horovod 0.28.1 over MPI for this torch), or pip install "
            f"'commopt[horovod]' with HOROVOD_WITH_PYTORCH=1 ({exc})"
        ) from exc
    if not hvd.is_initialized():
        # Process sets for split() need this before init.
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
        if not math.isinf(timeout_s):
            os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", f"{min(60, timeout_s / 2):g}")
            os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", f"{timeout_s:g}")
        horovod_exit.prepare_mpi(hvd)
        hvd.init()
        _OWNS_INIT = True
        horovod_exit.install(hvd)  # a rank that leaves early is named by its peers
    return hvd


class HandleWork(Work):
    """A Work over a Horovod handle; ``finalize`` receives the operation's output.

    ``wait`` polls the handle; when it is not done ``limit_s`` seconds after it was issued
    (``what``, ``peers`` name the operation and its ranks in the error), it raises CommError;
    when a peer left the job and the handle got no result within a grace, PeerLeftError
    (:class:`commopt.comm.horovod_exit.DepartureWatch`).
    """

    def __init__(
        self,
        hvd,
        handle,
        finalize: Callable[[Any], object] | None = None,
        *,
        what: str = "an operation",
        peers: str = "",
        limit_s: float = math.inf,
    ):
        self._hvd, self._handle, self._finalize = hvd, handle, finalize
        self._done = False
        self._what, self._peers, self._limit_s = what, peers, limit_s
        self._issued = time.monotonic()

    def _bounded(self) -> None:
        """Poll until the operation is done: at most ``limit_s`` after its issue, and at most
        a grace after a peer's departure notice (a departure can lose an operation)."""
        pause = 1e-4
        departure = horovod_exit.DepartureWatch(self._what)
        while not self._hvd.poll(self._handle):
            departure.check()
            if time.monotonic() - self._issued > self._limit_s:
                # Horovod's own shutdown would wait on the dead operation: the job ends at exit.
                horovod_exit.abort_at_exit()
                raise CommError(
                    f"rank {self._hvd.rank()}: Horovod's {self._what} did not complete within "
                    f"{self._limit_s:g}s of being issued, waiting for rank(s) {self._peers} "
                    f"(Horovod does not say which was silent): a link is down, or a peer "
                    f"stopped or never entered it (${COMM_TIMEOUT_ENV} or "
                    f"create_communicator(timeout=) sets the limit)."
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def wait(self) -> None:
        if self._done:
            return
        with horovod_exit.naming_departures():
            self._bounded()
            output = self._hvd.synchronize(self._handle)
        self._done = True
        if self._finalize is not None:
            self._finalize(output)

    def is_completed(self) -> bool:
        return self._done or bool(self._hvd.poll(self._handle))


def _movable(t: torch.Tensor) -> torch.Tensor:
    """A view Horovod can move: bf16 travels as its raw 16-bit words."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


class HorovodCommunicator(Communicator):
    """Communicator over Horovod's global process set (or one made by ``split``).

    Ranks follow Horovod's; ``intra_*``/``inter_*`` come from node names as for every
    communicator (``COMMOPT_NODE_NAME`` may fake nodes). ``timeout`` (see
    :mod:`commopt.comm.timeout`) bounds every wait for an operation, counted from its issue,
    and sets Horovod's stall shutdown (:func:`_hvd`).
    """

    name = "horovod"

    def __init__(
        self,
        *,
        allreduce_grad_dtype: torch.dtype | None = None,
        timeout: float | str | None = None,
        _process_set=None,
        _order: list[int] | None = None,
        _tag: str = "w",
    ):
        super().__init__(allreduce_grad_dtype=allreduce_grad_dtype)
        self.timeout = comm_timeout(timeout)
        hvd = self._hvd = _hvd(self.timeout)
        # Only a communicator not made by split owns Horovod's shutdown (a split over every
        # rank runs on the global process set too).
        self._top_level = _process_set is None
        self._ps = hvd.global_process_set if _process_set is None else _process_set
        is_world = self._ps is hvd.global_process_set
        members = list(range(hvd.size())) if is_world else sorted(self._ps.ranks)
        # _order[i] = Horovod set-rank of this communicator's rank i (split may reorder by key).
        self._order = _order if _order is not None else list(range(len(members)))
        self._members = members
        self.size = len(members)
        self._world_rank = hvd.rank()
        self.rank = self._order.index(members.index(self._world_rank))
        self._tag = _tag
        self._count = 0
        self._lock = threading.Lock()
        self._init_topology()

    # -- helpers ---------------------------------------------------------------------------------
    def _peers(self) -> str:
        return ", ".join(str(m) for i, m in enumerate(self._members) if i != self._order[self.rank])

    def _handle_work(self, handle, what: str, finalize=None) -> HandleWork:
        return HandleWork(
            self._hvd, handle, finalize, what=what, peers=self._peers(), limit_s=self.timeout
        )

    def _deadline(self, what: str, verb: str):
        """A native deadline (see :mod:`commopt.comm.deadline`) on a call into Horovod.

        With dynamic process sets, Horovod's background thread holds its process-set lock
        through a blocking MPI exchange every cycle, and Horovod's functions that start an
        operation take that lock while they hold the GIL: once a link is down, the first such
        call freezes every Python thread of this rank (the bounded waits included).
        """
        return deadline(
            self.timeout,
            f"commopt: rank {self._world_rank}: Horovod's {what} did not {verb} within "
            f"{self.timeout:g}s, waiting for rank(s) {self._peers()}: Horovod's background "
            f"thread is stuck in an MPI call (a link is down, or a peer stopped), and this "
            f"rank is frozen behind it (${COMM_TIMEOUT_ENV} or create_communicator(timeout=) "
            f"sets the limit); ending the job.\n",
        )

    def _issue(self, what: str, start: Callable[..., Any], *args, **kwargs):
        """Start a Horovod operation, within the timeout; if Horovod is shut down, say which
        rank left, if one did.

        Not once an operation timed out: Horovod's background thread is stuck, and starting
        another would freeze this rank before it reports the error it already has.
        """
        self._unless_ending(what)
        with (
            horovod_exit.starting(what),
            horovod_exit.naming_departures(),
            self._deadline(what, "start"),
        ):
            return start(*args, **kwargs)

    def _unless_ending(self, what: str) -> None:
        if horovod_exit.aborting():
            raise CommError(
                f"rank {self._world_rank}: not starting Horovod's {what}: an earlier Horovod "
                f"operation made no progress within {self.timeout:g}s (the job is ending)"
            )

    def _name(self, op: str) -> str:
        with self._lock:  # one counter value per operation, even with several threads
            self._count += 1
            return f"commopt.{self._tag}.{op}.{self._count}"

    def _reordered(self) -> bool:
        return self._order != sorted(self._order)

    def _to_set_order(self, chunks: torch.Tensor) -> torch.Tensor:
        """Rows indexed by our ranks -> rows indexed by Horovod set-ranks."""
        out = torch.empty_like(chunks)
        out[self._order] = chunks
        return out

    def _from_set_order(self, chunks: torch.Tensor) -> torch.Tensor:
        return chunks[self._order]

    # -- primitives --------------------------------------------------------------------------------
    def _allreduce(self, buf: torch.Tensor) -> Work:
        hvd = self._hvd
        if buf.numel() == 0 or self.size == 1:
            return _DONE
        if buf.dtype == torch.bfloat16:  # no bf16 in Horovod: sum in fp32, round once
            wide = buf.float()
            handle = self._issue(
                "allreduce",
                hvd.allreduce_async_,
                wide,
                op=hvd.Sum,
                name=self._name("allreduce"),
                process_set=self._ps,
            )
            return self._handle_work(handle, "allreduce", lambda _out: buf.copy_(wide))
        handle = self._issue(
            "allreduce",
            hvd.allreduce_async_,
            buf,
            op=hvd.Sum,
            name=self._name("allreduce"),
            process_set=self._ps,
        )
        return self._handle_work(handle, "allreduce")

    def _nothing_to_send(self, send: torch.Tensor, recv: torch.Tensor) -> bool:
        """True when an exchange has no peer to reach: empty, or one rank (``recv`` gets ``send``)."""
        if send.numel() == 0 or self.size == 1:
            if self.size == 1 and recv.data_ptr() != send.data_ptr():
                recv.copy_(send)
            return True
        return False

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        hvd = self._hvd
        if self._nothing_to_send(send, recv):
            return _DONE
        rows = _movable(send).reshape(self.size, -1)
        if self._reordered():
            rows = self._to_set_order(rows)
        handle = self._issue(
            "alltoall",
            hvd.alltoall_async,
            rows.contiguous(),
            name=self._name("alltoall"),
            process_set=self._ps,
        )

        def finish(output):
            got = output[0] if isinstance(output, tuple) else output
            got = got.reshape(self.size, -1)
            if self._reordered():
                got = self._from_set_order(got)
            _movable(recv).view(self.size, -1).copy_(got)

        return self._handle_work(handle, "alltoall", finish)

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        hvd = self._hvd
        if self._nothing_to_send(send, recv):
            return _DONE
        handle = self._issue(
            "allgather",
            hvd.allgather_async,
            _movable(send).reshape(-1),
            name=self._name("allgather"),
            process_set=self._ps,
        )

        def finish(output):
            got = output.reshape(self.size, -1)
            if self._reordered():
                got = self._from_set_order(got)
            _movable(recv).view(self.size, -1).copy_(got)

        return self._handle_work(handle, "allgather", finish)

    def _broadcast(self, buf: torch.Tensor, root: int) -> Work:
        hvd = self._hvd
        if buf.numel() == 0 or self.size == 1:
            return _DONE
        handle = self._issue(
            "broadcast",
            hvd.broadcast_async_,
            _movable(buf).reshape(-1),
            root_rank=self._order[root],
            name=self._name("broadcast"),
            process_set=self._ps,
        )
        return self._handle_work(handle, "broadcast")

    def _barrier(self) -> None:
        # A one-element allreduce, waited for as every operation is: Horovod's own barrier
        # blocks in Horovod without a bound, and never returns if it was queued while a
        # departing peer's shutdown drained Horovod's queue.
        if self.size == 1:
            return
        hvd = self._hvd
        token = torch.zeros(1, dtype=torch.int32)
        handle = self._issue(
            "barrier",
            hvd.allreduce_async_,
            token,
            op=hvd.Sum,
            name=self._name("barrier"),
            process_set=self._ps,
        )
        self._handle_work(handle, "barrier").wait()

    # Objects (bcast_obj/allgather_obj) use the base class's JSON + bytes path over this
    # communicator's own collectives: Horovod's *_object helpers pickle and have no process set.

    def _split(self, color: int, key: int) -> HorovodCommunicator:
        if self._ps is not self._hvd.global_process_set:
            raise NotImplementedError(
                "a Horovod communicator made by split() cannot be split again: Horovod process "
                "sets are registered by all ranks together. Split the top-level communicator."
            )
        hvd = self._hvd
        everyone = self.allgather_obj((color, key, self.rank))
        groups: dict[int, list[tuple[int, int]]] = {}
        for c, k, r in everyone:
            groups.setdefault(c, []).append((k, r))
        # Every rank registers every group, in the same order (a collective over all ranks).
        mine: tuple[int, tuple[int, ...]] | None = None
        for c in sorted(groups):
            ranks = tuple(sorted(r for _, r in groups[c]))
            if ranks not in _PROCESS_SETS:
                _PROCESS_SETS[ranks] = (
                    hvd.global_process_set
                    if len(ranks) == hvd.size()
                    else hvd.add_process_set(list(ranks))
                )
            if c == color:
                mine = (c, ranks)
        if mine is None:  # our own (color, key, rank) is in everyone: a broken allgather_obj
            raise RuntimeError(f"rank {self.rank}: _split: color {color} missing from the gather")
        c, ranks = mine
        by_key = [r for _, r in sorted(groups[c])]  # our new rank order: by key, then old rank
        order = [ranks.index(r) for r in by_key]
        return HorovodCommunicator(
            allreduce_grad_dtype=self.allreduce_grad_dtype,
            timeout=self.timeout,
            _process_set=_PROCESS_SETS[ranks],
            _order=order,
            _tag=f"{self._tag}.s{c}",
        )

    def supports_sum(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64)

    def _release(self) -> None:
        """Shut Horovod down if this module started it (top-level communicator only)."""
        global _OWNS_INIT
        if _OWNS_INIT and self._top_level and self._hvd.is_initialized():
            self._hvd.shutdown()
            _OWNS_INIT = False
            _PROCESS_SETS.clear()
