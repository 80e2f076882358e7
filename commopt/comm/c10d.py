"""A commopt Communicator over raw c10d backends (ProcessGroupGloo / ProcessGroupNCCL objects).

The ``commopt`` torch.distributed backend (:mod:`commopt.integrations.backend`) runs
commopt's compressed allreduce while torch.distributed is still creating the process group,
so it cannot use a registered group (and :class:`~commopt.comm.torch_dist.TorchCommunicator`
needs one). This communicator drives c10d backend objects directly: one per device type,
created from the group's own store under their own prefix, so its traffic never mixes with
the collectives that pass through to gloo or nccl. ``pure_nccl`` started by torchrun
bootstraps over it (gloo only), with no MPI.

It counts what it hands to the transport (``sent_bytes``: the bytes of every send buffer),
which is how tests and users see that compression happened.

    >>> import datetime, torch, torch.distributed as dist
    >>> store = dist.HashStore()
    >>> comm = C10dCommunicator(store, rank=0, size=1, timeout=datetime.timedelta(seconds=30))
    >>> t = torch.ones(3); comm.allreduce(t); t.tolist()
    [1.0, 1.0, 1.0]

``bcast_obj``/``allgather_obj`` carry JSON (strings, numbers, lists), never pickles. The
node of each rank (host name, or ``COMMOPT_NODE_NAME``) is exchanged at construction, and
``split`` makes sub-communicators from the same store, so ``commopt.collectives`` can run
its hierarchical algorithm across nodes.
"""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commopt.comm.base import C10D_SUM_DTYPES, Communicator, Work

__all__ = ["C10dCommunicator"]


class _C10dWork(Work):
    def __init__(self, work):
        self._work = work

    def wait(self) -> None:
        self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class C10dCommunicator(Communicator):
    """Communicator over gloo (CPU tensors) and, when CUDA is available, nccl (CUDA tensors).

    ``store``: a c10d Store shared by the ranks (give each communicator its own prefix).
    """

    name = "c10d"

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        *,
        use_cuda: bool | None = None,
        on_send: Callable[[int], None] | None = None,
    ):
        super().__init__()
        self.rank, self.size = int(rank), int(size)
        self._store, self._timeout = store, timeout
        self._backends: dict[str, Any] = {
            "cpu": dist.ProcessGroupGloo(
                dist.PrefixStore("gloo/", store), self.rank, self.size, timeout
            )
        }
        if (
            torch.cuda.is_available() if use_cuda is None else use_cuda
        ) and dist.is_nccl_available():
            # options has a default at run time; the stubs make it required
            self._backends["cuda"] = dist.ProcessGroupNCCL(  # type: ignore[call-arg]
                dist.PrefixStore("nccl/", store), self.rank, self.size
            )
        self._lock = threading.Lock()
        self.sent_bytes = 0
        #: called with each send's byte count (under a lock), e.g. to keep a running total;
        #: communicators made by ``split`` report to their parent's
        self.on_send = on_send
        self._splits = 0
        self._init_topology()  # the node names travel uncounted: they are not payload

    def _backend(self, t: torch.Tensor):
        try:
            return self._backends[t.device.type]
        except KeyError:
            raise RuntimeError(
                f"the commopt backend has no transport for {t.device.type} tensors "
                f"(it has {', '.join(self._backends)})"
            ) from None

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.sent_bytes += int(nbytes)
            if self.on_send is not None:
                self.on_send(int(nbytes))

    # gloo (torch >= 2.1) and nccl sum fp16 and bf16 themselves.
    def supports_sum(self, dtype: torch.dtype) -> bool:
        return dtype in C10D_SUM_DTYPES

    def _allreduce(self, buf: torch.Tensor) -> Work:
        self._count(buf.numel() * buf.element_size())
        return _C10dWork(self._backend(buf).allreduce([buf]))

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        s, r = _as_bytes(send), _as_bytes(recv)
        self._count(s.numel() - s.numel() // self.size)  # the own chunk does not travel
        return _C10dWork(self._backend(send).alltoall_base(r, s, [], []))

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        self._count(send.numel() * send.element_size() * (self.size - 1))
        return self._raw_allgather(send, recv)

    def _raw_allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        s, r = _as_bytes(send), _as_bytes(recv)
        outputs = list(r.view(self.size, -1).unbind(0))
        return _C10dWork(self._backend(send).allgather([outputs], [s]))

    def _broadcast(self, buf: torch.Tensor, root: int) -> Work:
        b = _as_bytes(buf)
        if self.rank == root:
            self._count(b.numel() * (self.size - 1))
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return _C10dWork(self._backend(buf).broadcast([b], opts))

    def _barrier(self) -> None:
        self._backends["cpu"].barrier().wait()

    # -- small objects: length-prefixed JSON over gloo, never unpickled --------------------
    def _bcast_obj(self, obj: Any, root: int) -> Any:
        data = json.dumps(obj).encode() if self.rank == root else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        self._broadcast(n, root).wait()
        buf = torch.zeros(int(n.item()), dtype=torch.uint8)
        if self.rank == root:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if buf.numel():
            self._broadcast(buf, root).wait()
        return json.loads(bytes(buf.tolist()).decode())

    def _allgather_obj(self, obj: Any) -> list:
        data = json.dumps(obj).encode()
        sizes = torch.zeros(self.size, dtype=torch.int64)
        self._raw_allgather(torch.tensor([len(data)], dtype=torch.int64), sizes).wait()
        width = int(sizes.max().item())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        )
        everyone = torch.zeros(self.size * width, dtype=torch.uint8)
        self._raw_allgather(mine, everyone).wait()
        rows = everyone.view(self.size, width)
        return [
            json.loads(bytes(rows[r, : int(sizes[r])].tolist()).decode()) for r in range(self.size)
        ]

    def _split(self, color: int, key: int) -> Communicator:
        # Collective over this communicator: every rank learns every (color, key, rank) and
        # the members of each color build their backends under a prefix of their own.
        triples = self._allgather_obj([color, key, self.rank])
        members = [r for _, r in sorted((k, r) for c, k, r in triples if c == color)]
        self._splits += 1
        store = dist.PrefixStore(f"split{self._splits}/{color}/", self._store)
        return C10dCommunicator(
            store,
            members.index(self.rank),
            len(members),
            self._timeout,
            use_cuda="cuda" in self._backends,
            on_send=self._count,
        )
