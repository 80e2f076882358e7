"""NCCL transport through CuPy's bindings ("pure_nccl"), bootstrapped over MPI, over
torch.distributed's store, or over nothing in a world of one.

    $ mpirun -np 8 python train.py      # each rank: torch.cuda.set_device(local_rank) first
    $ torchrun --nproc-per-node 8 train.py                     # the same, without MPI
    comm = commopt.create_communicator("pure_nccl", allreduce_grad_dtype="float16")

The NCCL communicator is created lazily, on the first collective, so the user sets the
CUDA device first (as ChainerMN's pure_nccl did): rank 0 makes the unique id, the
bootstrap broadcasts it, every rank joins. Object helpers, barrier and split run over the
bootstrap communicator. ``bootstrap=`` chooses it (:data:`BOOTSTRAPS`); ``"auto"`` (the
default) reads the launcher from the environment: MPI under mpirun or srun, a gloo group
on torch.distributed's store under torchrun (``env://``: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), and none for a plain process (a world of one).

Ordering is by CUDA streams, never by host threads (:mod:`commopt.comm.streams`): every
collective is enqueued from the calling thread. An event recorded on the caller's current
stream at issue time is what the communication stream waits for; ``Work.wait()`` makes the
caller's current stream wait for the collective (the host does not block) and
``Work.synchronize()`` blocks the host. The collectives' algorithms (codec kernels between
NCCL calls) run inline on the calling thread with the communication stream current
(:mod:`commopt.driver`). A communicator and every communicator split from it share one
communication stream, so all their NCCL calls run in one order, the issue order, which is
the same on every rank when every rank runs the same program.

Threads: call from one thread at a time, in the same order on every rank.
``finalize()`` destroys the NCCL communicator and frees the bootstrap communicator.
"""

from __future__ import annotations

from typing import Any

import torch

from commopt.comm.base import C10D_SUM_DTYPES, Communicator, Work
from commopt.comm.errors import CommError
from commopt.comm.streams import CudaStreams, StreamWork, issue_after_caller, synchronize_bounded
from commopt.comm.timeout import COMM_TIMEOUT_ENV, comm_timeout

# ncclDataType_t values (nccl.h); stable across NCCL 2.x.
_NCCL_DTYPE = {
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
_NCCL_SUM = 0


_INSTALL = (
    "pip install 'commopt[nccl]' (cupy-cuda13x, for CUDA 13 as torch's wheels are) on a "
    "machine with CUDA"
)


def nccl_unavailable_reason() -> str | None:
    """Why CuPy's NCCL cannot be used here (what to install), or None when it can."""
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl
    except ImportError as exc:
        return f"the 'pure_nccl' communicator needs CuPy with NCCL: {_INSTALL} ({exc})"
    if not getattr(nccl, "available", False):
        return (
            "CuPy is installed but found no NCCL library (cupy.cuda.nccl.available is False): "
            "install NCCL for your CUDA (pip install nvidia-nccl-cu13, or the libnccl2 "
            f"package), or reinstall with {_INSTALL}"
        )
    return None


def _cupy_nccl():
    reason = nccl_unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    from cupy.cuda import nccl

    return nccl


class _NcclStreams(CudaStreams):
    """CUDA streams plus the NCCL communicator's lifetime (what StreamTrace records instead)."""

    def nccl_unique_id(self):
        return _cupy_nccl().get_unique_id()  # bytes (CuPy 14): the bootstrap carries them as is

    def nccl_init(self, size: int, rank: int, unique_id):
        return _cupy_nccl().NcclCommunicator(size, unique_id, rank)

    def nccl_destroy(self, comm) -> None:
        comm.destroy()

    def nccl_check(self, comm) -> None:
        """Raise NCCL's asynchronous error of ``comm`` (a peer failed), if it has one."""
        comm.check_async_error()

    def nccl_abort(self, comm) -> None:
        """ncclCommAbort: end ``comm``'s operations in flight so no stream waits on them."""
        comm.abort()


class _NcclWork(Work):
    """A pure_nccl collective: stream-ordered, with a host wait bounded by the timeout."""

    def __init__(self, work: StreamWork, comm: NcclCommunicator, what: str):
        self._work, self._comm, self._what = work, comm, what

    def wait(self) -> None:
        self._work.wait()

    def synchronize(self) -> None:
        self._comm.host_wait(self._work, self._what)

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _Shared:
    """What a communicator and the ones split from it share: the device and its one stream."""

    def __init__(self, streams):
        self.streams = streams
        self.device = None
        self.stream = None

    def ensure(self):
        if self.stream is None:
            self.device = self.streams.current_device()
            self.stream = self.streams.new_stream(self.device)
        return self.stream


#: How a pure_nccl communicator's ranks meet: "mpi" (MPI_COMM_WORLD, or ``mpi_comm``),
#: "store" (a gloo group on torch.distributed's store: torchrun's ``env://`` variables),
#: "none" (a world of one) and "auto" (chosen from the launcher's environment).
BOOTSTRAPS = ("auto", "mpi", "store", "none")


def choose_bootstrap(bootstrap: str = "auto", *, env=None, mpi_comm=None) -> str:
    """The bootstrap ``"auto"`` stands for here: MPI under an MPI launcher (or when
    ``mpi_comm`` is given), the store under torchrun, none for a plain process.

    >>> choose_bootstrap(env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    'store'
    >>> choose_bootstrap(env={"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    'mpi'
    >>> choose_bootstrap(env={})
    'none'
    """
    if bootstrap not in BOOTSTRAPS:
        raise ValueError(
            f"pure_nccl bootstrap={bootstrap!r}: choose one of {', '.join(BOOTSTRAPS)}"
        )
    if bootstrap != "auto":
        return bootstrap
    if mpi_comm is not None:
        return "mpi"
    from commopt.comm.launcher import detect_launcher

    info = detect_launcher(env)
    if info.name == "torchrun":
        return "store"
    if info.name == "none" and info.size == 1:
        return "none"
    return "mpi"


def _bootstrap(kind: str, *, mpi_comm, timeout: float) -> Communicator:
    """The communicator the ranks meet over (rank, size, nodes, objects, barrier, split)."""
    if kind == "none":
        from commopt.comm.local import LocalCommunicator

        return LocalCommunicator()
    if kind == "store":
        import torch.distributed as dist

        from commopt.comm.torch_dist import TorchCommunicator

        if not dist.is_initialized():  # a gloo default group on torchrun's store
            return TorchCommunicator(backend="gloo", timeout=timeout)
        # the program's own group may be nccl: objects and barriers need a CPU one
        return TorchCommunicator(group=dist.new_group(backend="gloo"), timeout=timeout)
    if mpi_comm is None:
        try:
            from mpi4py import MPI  # noqa: F401  (mpi4py installs without an MPI library)
        except (ImportError, RuntimeError) as exc:
            raise RuntimeError(
                f"pure_nccl's MPI bootstrap cannot load MPI ({exc}): start the job with "
                "torchrun (bootstrap='store' or 'auto'), run one process (a world of one "
                "needs no bootstrap), or install an MPI library for mpi4py"
            ) from exc
    from commopt.comm.mpi import MPICommunicator

    return MPICommunicator(mpi_comm=mpi_comm, timeout=timeout)


class NcclCommunicator(Communicator):
    """Communicator over NCCL (CUDA tensors only). Options: ``bootstrap`` (how the ranks meet,
    :func:`choose_bootstrap`), ``mpi_comm`` for an MPI bootstrap, ``timeout`` (see
    :mod:`commopt.comm.timeout`).

    Bounded waits: every host wait (``Work.synchronize``, ``barrier``, ``finalize``) polls
    the collective's event and NCCL's asynchronous error; an error, or no completion within
    the timeout, aborts the NCCL communicator (ncclCommAbort) and raises CommError naming the
    collective, so a dead peer cannot hold the host in ``event.synchronize()`` forever.
    (NCCL does not say which peer was silent.)
    """

    name = "pure_nccl"
    #: Work is ordered by CUDA streams; the driver issues the collectives inline.
    stream_ordered = True

    def __init__(
        self,
        *,
        allreduce_grad_dtype: torch.dtype | None = None,
        bootstrap: str = "auto",
        mpi_comm=None,
        timeout: float | str | None = None,
        _streams=None,
        _boot=None,
        _shared: _Shared | None = None,
    ):
        super().__init__(allreduce_grad_dtype=allreduce_grad_dtype)
        if _streams is None and _shared is None:
            _cupy_nccl()  # fail early, with the install hint, if CuPy is missing
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "the 'pure_nccl' communicator needs a CUDA device; use 'mpi' or 'torch' on CPU"
                )
        self.timeout = comm_timeout(timeout)
        self._shared = _shared if _shared is not None else _Shared(_streams or _NcclStreams())
        self.streams = self._shared.streams
        # The bootstrap: our own (an MPI duplicate, a gloo group, or none), or (split) the
        # sub-communicator made for us.
        if _boot is None:
            self.bootstrap = choose_bootstrap(bootstrap, mpi_comm=mpi_comm)
            _boot = _bootstrap(self.bootstrap, mpi_comm=mpi_comm, timeout=self.timeout)
        else:
            self.bootstrap = "split"
        self._boot = _boot
        self.rank, self.size = self._boot.rank, self._boot.size
        self.intra_rank, self.intra_size = self._boot.intra_rank, self._boot.intra_size
        self.inter_rank, self.inter_size = self._boot.inter_rank, self._boot.inter_size
        self.node_name = self._boot.node_name
        self.node_names = list(self._boot.node_names)  # hierarchical reduction needs them
        self._nccl_comm = None
        self._finalized = False
        self._children: list[NcclCommunicator] = []  # split from this one: finalized with it

    def codec_stream(self, device=None):
        """The communication stream: the collectives' codec kernels run there too."""
        return self._shared.ensure()

    def _ensure(self):
        """Create the NCCL communicator (and the shared stream) on first use, on the current device."""
        if self._finalized:
            raise RuntimeError("this pure_nccl communicator was finalized; create a new one")
        if self._nccl_comm is None:
            self._shared.ensure()
            uid = self.streams.nccl_unique_id() if self.rank == 0 else None
            uid = self._boot.bcast_obj(uid, root=0)
            self._nccl_comm = self.streams.nccl_init(self.size, self.rank, uid)
        return self._nccl_comm

    def _launch(self, tensors, what: str, enqueue) -> Work:
        for t in tensors:
            if not self.streams.is_device_tensor(t):
                raise TypeError(
                    "pure_nccl moves CUDA tensors only; use the 'mpi' communicator for CPU tensors"
                )
        comm = self._ensure()
        stream = self._shared.stream
        work = issue_after_caller(
            self.streams,
            stream,
            self._shared.device,
            lambda: self.streams.enqueue(stream, what, lambda s: enqueue(comm, s)),
            keep=tensors,
        )
        nbytes = sum(t.numel() * t.element_size() for t in tensors[:1])
        return _NcclWork(work, self, f"{what} of {nbytes} bytes")

    def host_wait(self, work: StreamWork, what: str) -> None:
        """Block the host until ``work`` is done: bounded by the timeout, NCCL errors raised."""
        comm = self._nccl_comm
        try:
            done = synchronize_bounded(
                work, self.timeout, None if comm is None else lambda: self.streams.nccl_check(comm)
            )
        except Exception as exc:  # NCCL's asynchronous error: a peer failed
            self._abort()
            raise CommError(
                f"rank {self.rank}: NCCL reported an error during {what}: {exc}. The NCCL "
                f"communicator was aborted; a peer failed or its link is down."
            ) from exc
        if not done:
            self._abort()
            peers = ", ".join(str(r) for r in range(self.size) if r != self.rank)
            raise CommError(
                f"rank {self.rank}: {what} over NCCL did not complete within {self.timeout:g}s "
                f"while this rank waited for it; its peers are rank(s) {peers} (NCCL does not "
                f"say which was silent): a link is down, or a peer stopped or never entered "
                f"this collective. The NCCL communicator was aborted (ncclCommAbort). "
                f"(${COMM_TIMEOUT_ENV} or create_communicator(timeout=) sets the limit)"
            )

    def _abort(self) -> None:
        """ncclCommAbort on this communicator; it cannot be used afterwards."""
        if self._nccl_comm is not None:
            comm, self._nccl_comm = self._nccl_comm, None
            self.streams.nccl_abort(comm)
        self._finalized = True

    def _stream_done(self, what: str) -> None:
        """Wait (bounded) for everything enqueued on the communication stream so far."""
        stream = self._shared.stream
        event = self.streams.record(stream)
        self.host_wait(StreamWork(self.streams, event, self._shared.device, stream), what)

    def _allreduce(self, buf: torch.Tensor) -> Work:
        return self._launch(
            [buf],
            "allReduce",
            lambda c, s: c.allReduce(
                buf.data_ptr(), buf.data_ptr(), buf.numel(), _NCCL_DTYPE[buf.dtype], _NCCL_SUM, s
            ),
        )

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        nbytes = send.numel() * send.element_size() // self.size

        def enqueue(c, s):
            nccl = _cupy_nccl()
            nccl.groupStart()
            for peer in range(self.size):
                c.send(send.data_ptr() + peer * nbytes, nbytes, 1, peer, s)
                c.recv(recv.data_ptr() + peer * nbytes, nbytes, 1, peer, s)
            nccl.groupEnd()

        return self._launch([send, recv], "alltoall", enqueue)

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        nbytes = send.numel() * send.element_size()
        return self._launch(
            [send, recv],
            "allGather",
            lambda c, s: c.allGather(send.data_ptr(), recv.data_ptr(), nbytes, 1, s),
        )

    def _broadcast(self, buf: torch.Tensor, root: int) -> Work:
        nbytes = buf.numel() * buf.element_size()
        return self._launch(
            [buf], "bcast", lambda c, s: c.bcast(buf.data_ptr(), nbytes, 1, root, s)
        )

    def _barrier(self) -> None:
        if self._shared.stream is not None:
            self._stream_done("barrier")
        self._boot.barrier()

    def _bcast_obj(self, obj: Any, root: int) -> Any:
        return self._boot.bcast_obj(obj, root)

    def _allgather_obj(self, obj: Any) -> list:
        return self._boot.allgather_obj(obj)

    def _split(self, color: int, key: int) -> NcclCommunicator:
        # The bootstrap's sub-communicator becomes the child's bootstrap as it is (no second
        # duplicate, no orphaned worker); the child enqueues on the parent's stream.
        sub = self._boot.split(color, key)
        child = NcclCommunicator(
            allreduce_grad_dtype=self.allreduce_grad_dtype,
            timeout=self.timeout,
            _boot=sub,
            _shared=self._shared,
        )
        self._children.append(child)
        return child

    def supports_sum(self, dtype: torch.dtype) -> bool:
        return dtype in C10D_SUM_DTYPES

    def _release(self) -> None:
        """Wait for the work in flight; destroy the NCCL communicators (this one and those
        split from it) and free their bootstrap communicators. Safe to call twice."""
        if self._finalized:
            return
        self._finalized = True
        for child in self._children:
            child.finalize()
        self._children = []
        if self._nccl_comm is not None:
            self._stream_done("finalize")  # an abort there leaves nothing to destroy
            if self._nccl_comm is not None:
                self.streams.nccl_destroy(self._nccl_comm)
                self._nccl_comm = None
        self._boot.finalize()
