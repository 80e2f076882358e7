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
(docs/benchmarks.md). Eager-sized segments need no handshake, and keeping many in
flight fills both directions at once. ``pipeline="off"`` (or ``COMMOPT_MPI_PIPELINE=off``)
restores MPI's own blocking collectives everywhere; ``"on"`` uses the pipelined path within
a node too. Extra memory: one scratch buffer of 1/size of the largest allreduce.

A Python exception that escapes on any rank aborts the whole job (MPI_Abort) after its
traceback is printed, so the other ranks do not wait forever in a collective.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from commopt.comm.base import Communicator, FutureWork, Work

_MPI = None
_USER_OPS: dict[torch.dtype, Any] = {}


def _mpi():
    """Import mpi4py lazily; a missing package names what to install."""
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the 'mpi' communicator needs mpi4py and an MPI library: "
                "pip install 'commopt[mpi]' (and apt-get install openmpi-bin libopenmpi-dev)"
            ) from exc
        _MPI = MPI
        _install_abort_hook(MPI)
    return _MPI


def _install_abort_hook(MPI) -> None:
    """An uncaught exception on one rank aborts the job instead of hanging its peers."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


# -- 16-bit reductions ---------------------------------------------------------------------
def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does; NaN stays NaN."""
    bits = f32.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def _sum_fp16(inbuf, inoutbuf, datatype) -> None:
    a = np.frombuffer(inbuf, dtype=np.float16)
    b = np.frombuffer(inoutbuf, dtype=np.float16)
    # Add in fp32 and round once: the same as torch's fp16 addition.
    b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)


def _sum_bf16(inbuf, inoutbuf, datatype) -> None:
    a = np.frombuffer(inbuf, dtype=np.uint16)
    b = np.frombuffer(inoutbuf, dtype=np.uint16)
    b[...] = _f32_to_bf16(_bf16_to_f32(a) + _bf16_to_f32(b))


def _user_op(dtype: torch.dtype):
    MPI = _mpi()
    if dtype not in _USER_OPS:
        fn = _sum_fp16 if dtype == torch.float16 else _sum_bf16
        _USER_OPS[dtype] = MPI.Op.Create(fn, commute=True)
    return _USER_OPS[dtype]


def _mpi_type(dtype: torch.dtype):
    MPI = _mpi()
    return {
        torch.float32: MPI.FLOAT,
        torch.float64: MPI.DOUBLE,
        torch.int32: MPI.INT32_T,
        torch.int64: MPI.INT64_T,
        torch.float16: MPI.INT16_T,  # raw 16-bit words, summed by a user-defined op
        torch.bfloat16: MPI.INT16_T,
    }[dtype]


def _numpy_view(t: torch.Tensor, as_bytes: bool = False) -> np.ndarray:
    """A NumPy array sharing memory with the contiguous CPU tensor ``t``."""
    flat = t.reshape(-1)
    if as_bytes:
        return flat.view(torch.uint8).numpy()
    if t.dtype in (torch.float16, torch.bfloat16):
        return flat.view(torch.int16).numpy()
    return flat.numpy()


# -- pipelined transfers for large buffers between nodes --------------------------------------
PIPELINE_ENV = "COMMOPT_MPI_PIPELINE"                  # auto (default), on, off
SEGMENT_ENV = "COMMOPT_MPI_SEGMENT_BYTES"              # default: from the eager limit
PIPELINE_MIN_ENV = "COMMOPT_MPI_PIPELINE_MIN_BYTES"    # default: DEFAULT_PIPELINE_MIN_BYTES
#: Open MPI's TCP eager limit (bytes, header included) when nothing else says otherwise.
OMPI_TCP_EAGER_DEFAULT = 64 * 1024
#: Below this a buffer goes to MPI's own collective: few segments, nothing to pipeline.
DEFAULT_PIPELINE_MIN_BYTES = 256 * 1024
_HEADER_SLACK = 1024  # room for the PML/BTL headers, which count against the eager limit
# Tag bases: each pipelined operation uses its own range of point-to-point tags (MPI keeps
# them apart from the collectives' traffic on the same communicator).
_TAG_ALLTOALL, _TAG_ALLGATHER, _TAG_RING = 1, 2, 16  # the ring uses _TAG_RING + step
_PIPELINE_MODES = {"auto": "auto", "on": "on", "1": "on", "true": "on", "yes": "on",
                   "off": "off", "0": "off", "false": "off", "no": "off"}


def _parse_bytes(text, what: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, KeyError):
        value = -1
    if value < 0:
        raise ValueError(f"{what}={text!r}: give a number of bytes, e.g. 65536, 60K or 1M")
    return value


def pipeline_settings(pipeline=None, segment_bytes=None, min_bytes=None,
                      environ=None) -> tuple[str, int, int]:
    """(mode, segment bytes, smallest pipelined buffer) from the options, else the environment.

        >>> pipeline_settings("on", "1M", 0, environ={})
        ('on', 1048576, 0)
        >>> pipeline_settings(environ={"COMMOPT_MPI_PIPELINE": "off"})[0]
        'off'
    """
    environ = os.environ if environ is None else environ
    if pipeline is None:
        pipeline = environ.get(PIPELINE_ENV, "auto")
    if isinstance(pipeline, bool):
        pipeline = "on" if pipeline else "off"
    mode = _PIPELINE_MODES.get(str(pipeline).strip().lower())
    if mode is None:
        raise ValueError(f"pipeline={pipeline!r}: use 'auto', 'on' or 'off' (option or "
                         f"{PIPELINE_ENV})")
    if segment_bytes is None:
        segment_bytes = environ.get(SEGMENT_ENV) or default_segment_bytes(environ)
    if min_bytes is None:
        min_bytes = environ.get(PIPELINE_MIN_ENV) or DEFAULT_PIPELINE_MIN_BYTES
    seg = _parse_bytes(segment_bytes, "segment_bytes")
    if seg < 8:
        raise ValueError(f"segment_bytes={segment_bytes!r} is too small: give at least 8 bytes "
                         f"(just under the transport's eager limit is best, e.g. 60K)")
    return mode, seg, _parse_bytes(min_bytes, "pipeline_min_bytes")


def transfer_path(mode: str, nbytes: int, *, size: int, inter_size: int, min_bytes: int) -> str:
    """How a collective of ``nbytes`` runs (the same answer on every rank).

    ``"pipelined"``: segmented point-to-point transfers (buffers of at least ``min_bytes``);
    ``"polled"``: MPI's own nonblocking collective, completed by polling with short sleeps
    (smaller buffers); ``"blocking"``: MPI's own blocking collective. ``auto`` uses the first
    two between nodes, where TCP carries the bytes, and the last within a node, where MPI's
    shared memory transport has no such problem; ``on`` uses them everywhere; ``off`` never.

        >>> transfer_path("auto", 64 << 20, size=2, inter_size=2, min_bytes=256 << 10)
        'pipelined'
        >>> transfer_path("auto", 4096, size=2, inter_size=2, min_bytes=256 << 10)
        'polled'
        >>> transfer_path("auto", 64 << 20, size=2, inter_size=1, min_bytes=256 << 10)
        'blocking'
    """
    if mode == "off" or size == 1 or (mode == "auto" and inter_size == 1):
        return "blocking"
    return "pipelined" if nbytes >= max(1, min_bytes) else "polled"


def default_segment_bytes(environ=None) -> int:
    """Segment size for pipelined transfers: just under the TCP eager limit.

    mpirun passes ``--mca btl_tcp_eager_limit`` to the ranks as
    ``OMPI_MCA_btl_tcp_eager_limit`` (``commopt launch`` sets 1 MiB); without it, Open MPI's
    default (64 KiB) applies.

        >>> default_segment_bytes({})
        61440
        >>> default_segment_bytes({"OMPI_MCA_btl_tcp_eager_limit": "1048576"})
        1044480
    """
    environ = os.environ if environ is None else environ
    limit = environ.get("OMPI_MCA_btl_tcp_eager_limit")
    limit = _parse_bytes(limit, "OMPI_MCA_btl_tcp_eager_limit") if limit else OMPI_TCP_EAGER_DEFAULT
    return max(4096, (limit - _HEADER_SLACK) // 4096 * 4096)


#: The longest sleep between two polls of a request (seconds). Waiting in MPI_Wait spins a
#: core: on a busy host a spinning rank loses its turn (and on the emulated cluster it takes
#: the core its peer needs), and while it spins it takes the core from the training thread
#: it should overlap with. The kernel's socket buffers (megabytes: tens of ms at 1 Gbit/s)
#: keep the link busy across a short sleep. 0 spins in MPI_Wait instead.
_POLL_SLEEP_S = float(os.environ.get("COMMOPT_MPI_POLL_SLEEP_US", "200")) * 1e-6
_FIRST_SLEEP_S = 10e-6


def _wait(req) -> None:
    """Complete ``req``, polling with sleeps that grow from 10 us to _POLL_SLEEP_S."""
    if _POLL_SLEEP_S <= 0:
        req.Wait()
        return
    nap = min(_FIRST_SLEEP_S, _POLL_SLEEP_S)
    while not req.Test():
        time.sleep(nap)
        nap = min(2 * nap, _POLL_SLEEP_S)


def _block_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive blocks of equal length; the trailing ones may be shorter or empty."""
    step = math.ceil(numel / parts)
    return [(min(i * step, numel), min((i + 1) * step, numel)) for i in range(parts)]


def _segments(lo: int, hi: int, seg: int):
    return [(a, min(a + seg, hi)) for a in range(lo, hi, seg)]


def ring_allreduce(mpi_comm, buf: torch.Tensor, seg_elems: int,
                   scratch: torch.Tensor | None = None) -> None:
    """Sum the contiguous CPU tensor ``buf`` over ``mpi_comm`` in place: segmented ring.

    Reduce-scatter then allgather around the ring (rank r sends to r+1), 2(n-1) steps, each
    moving one block of numel/n elements, cut into segments of ``seg_elems``. Every segment of
    a step is posted at once (Isend/Irecv), and segment k moves on to the next step as soon
    as it has arrived and been added, while later segments are still on the wire: reduction
    overlaps transfer and both directions of every link stay busy. Each block is summed once,
    by its owner, in ring order, and then copied to everyone: the result is bit-identical on
    every rank. ``scratch``: a uint8 CPU tensor of at least numel/n elements' bytes to hold
    incoming partial sums (allocated here if None).
    """
    n, r = mpi_comm.Get_size(), mpi_comm.Get_rank()
    if n == 1 or buf.numel() == 0:
        return
    right, left = (r + 1) % n, (r - 1) % n
    arr = _numpy_view(buf)
    blocks = _block_bounds(buf.numel(), n)
    block_len = blocks[0][1] - blocks[0][0]
    nbytes = block_len * buf.element_size()
    if scratch is None or scratch.numel() < nbytes:
        scratch = torch.empty(nbytes, dtype=torch.uint8)
    tmp = scratch[:nbytes].view(buf.dtype)  # incoming partial sums, one block
    tmp_arr = _numpy_view(tmp)
    steps = 2 * (n - 1)

    def blocks_of(t: int) -> tuple[int, int]:
        # Reduce-scatter step t sends block r-t-1 (summed at step t-1) and receives block
        # r-t-2; after n-1 steps rank r owns the full sum of block r. Allgather step s sends
        # block r-s and receives block r-s-1.
        if t < n - 1:
            return (r - t - 1) % n, (r - t - 2) % n
        s = t - (n - 1)
        return (r - s) % n, (r - s - 1) % n

    plan = []  # per step: (send segments, recv segments, recv block's start)
    for t in range(steps):
        sb, rb = blocks_of(t)
        plan.append((_segments(*blocks[sb], seg_elems), _segments(*blocks[rb], seg_elems),
                     blocks[rb][0]))
    pending: list[dict[int, tuple]] = [dict() for _ in range(steps)]

    def post(t: int, k: int) -> None:
        sends, recvs, start = plan[t]
        rreq = None
        if k < len(recvs):
            lo, hi = recvs[k]
            if t < n - 1:  # partial sums land aside, then get added
                rreq = mpi_comm.Irecv(tmp_arr[lo - start: hi - start], left, _TAG_RING + t)
            else:          # finished sums land in place
                rreq = mpi_comm.Irecv(arr[lo:hi], left, _TAG_RING + t)
        sreq = None
        if k < len(sends):
            lo, hi = sends[k]
            sreq = mpi_comm.Isend(arr[lo:hi], right, _TAG_RING + t)
        pending[t][k] = (rreq, sreq)

    width = max(max(len(sends), len(recvs)) for sends, recvs, _ in plan)
    for k in range(width):
        post(0, k)
    for t in range(steps):
        _, recvs, start = plan[t]
        for k in range(width):
            rreq, sreq = pending[t].pop(k)
            if rreq is not None:
                _wait(rreq)
                if t < n - 1:
                    lo, hi = recvs[k]
                    buf[lo:hi].add_(tmp[lo - start: hi - start])
            if sreq is not None:
                # The next step may receive into the memory this segment was sent from.
                _wait(sreq)
            if t + 1 < steps:
                post(t + 1, k)


def _exchange(mpi_comm, recv: np.ndarray, chunk: int, send_to, tag: int, seg_bytes: int) -> None:
    """Receive every peer's ``chunk`` bytes into its slot of ``recv`` and send each peer
    ``send_to(peer)``, all as segmented Irecv/Isend posted at once, then wait."""
    n, r = mpi_comm.Get_size(), mpi_comm.Get_rank()
    reqs = []
    for i in range(1, n):
        src = (r - i) % n
        for lo, hi in _segments(src * chunk, (src + 1) * chunk, seg_bytes):
            reqs.append(mpi_comm.Irecv(recv[lo:hi], src, tag))
    for i in range(1, n):
        dst = (r + i) % n
        data = send_to(dst)
        for lo, hi in _segments(0, data.size, seg_bytes):
            reqs.append(mpi_comm.Isend(data[lo:hi], dst, tag))
    for req in reqs:  # receives first, in the order they arrive
        _wait(req)


def pairwise_alltoall(mpi_comm, send: np.ndarray, recv: np.ndarray, seg_bytes: int) -> None:
    """MPI_Alltoall of equal byte chunks as segmented Isend/Irecv to and from every peer."""
    r = mpi_comm.Get_rank()
    chunk = send.size // mpi_comm.Get_size()
    recv[r * chunk:(r + 1) * chunk] = send[r * chunk:(r + 1) * chunk]
    _exchange(mpi_comm, recv, chunk, lambda dst: send[dst * chunk:(dst + 1) * chunk],
              _TAG_ALLTOALL, seg_bytes)


def direct_allgather(mpi_comm, send: np.ndarray, recv: np.ndarray, seg_bytes: int) -> None:
    """MPI_Allgather as segmented Isend/Irecv of this rank's bytes to and from every peer."""
    r = mpi_comm.Get_rank()
    chunk = send.size
    recv[r * chunk:(r + 1) * chunk] = send
    _exchange(mpi_comm, recv, chunk, lambda dst: send, _TAG_ALLGATHER, seg_bytes)


class MPICommunicator(Communicator):
    """Communicator over an mpi4py communicator (a duplicate of COMM_WORLD by default).

    Options: ``mpi_comm`` (an mpi4py communicator to duplicate), ``cuda_aware`` (force
    the CUDA-aware path on or off; by default asked from the MPI library), ``pipeline``
    (``"auto"``: when the ranks span several nodes, pipelined segment transfers for buffers
    of at least ``pipeline_min_bytes`` and polled nonblocking MPI collectives below;
    ``"on"``: the same on one node too; ``"off"``: MPI's own blocking collectives, as
    before), ``segment_bytes`` (default: just under the TCP eager limit, see
    :func:`default_segment_bytes`), ``pipeline_min_bytes`` (default 256 KiB). Environment:
    COMMOPT_MPI_PIPELINE, COMMOPT_MPI_SEGMENT_BYTES, COMMOPT_MPI_PIPELINE_MIN_BYTES (the
    options win). Every rank must use the same settings; the constructor checks.

        >>> comm = MPICommunicator(pipeline="off")          # doctest: +SKIP
    """

    name = "mpi"

    def __init__(self, *, allreduce_grad_dtype: torch.dtype | None = None, mpi_comm=None,
                 cuda_aware: bool | None = None, pipeline: str | bool | None = None,
                 segment_bytes: int | str | None = None,
                 pipeline_min_bytes: int | str | None = None, _dup: bool = True):
        super().__init__(allreduce_grad_dtype=allreduce_grad_dtype)
        MPI = _mpi()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        # Our own context keeps commopt's messages apart from the application's.
        self.mpi_comm = base.Dup() if _dup else base
        self.rank = self.mpi_comm.Get_rank()
        self.size = self.mpi_comm.Get_size()
        if cuda_aware is None:
            query = getattr(MPI, "Query_cuda_support", None)
            cuda_aware = bool(query()) if query is not None else False
        self.cuda_aware = cuda_aware
        self.pipeline, self.segment_bytes, self.pipeline_min_bytes = pipeline_settings(
            pipeline, segment_bytes, pipeline_min_bytes)
        self._scratch_buf: torch.Tensor | None = None
        self._thread_prefix = f"commopt-mpi-{id(self):x}"
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_prefix)
        self._lock = threading.Lock()
        self._init_topology()
        settings = (self.pipeline, self.segment_bytes, self.pipeline_min_bytes)
        everyone = self.allgather_obj(settings) if self.size > 1 else [settings]
        if any(x != settings for x in everyone):
            raise ValueError(
                f"rank {self.rank}: the ranks disagree on the MPI pipeline settings "
                f"(pipeline, segment_bytes, pipeline_min_bytes): {everyone}. Give every rank "
                f"the same {PIPELINE_ENV}, {SEGMENT_ENV}, {PIPELINE_MIN_ENV} and eager limit.")

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A reusable byte buffer for the worker thread (fresh pages cost a fault each)."""
        if self._scratch_buf is None or self._scratch_buf.numel() < nbytes:
            self._scratch_buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch_buf

    def _path(self, nbytes: int) -> str:
        """pipelined, polled or blocking: see :func:`transfer_path`."""
        return transfer_path(self.pipeline, nbytes, size=self.size, inter_size=self.inter_size,
                             min_bytes=self.pipeline_min_bytes)

    # -- running on the worker -------------------------------------------------------
    def _submit(self, fn: Callable[[], Any], finalize: Callable[[], None] | None = None) -> FutureWork:
        with self._lock:  # one submission order, even with several calling threads
            return FutureWork(self._worker.submit(fn), finalize)

    def _call(self, fn: Callable[[], Any]) -> Any:
        return self._worker.submit(fn).result() if not self._on_worker() else fn()

    def _on_worker(self) -> bool:
        return threading.current_thread().name.startswith(self._thread_prefix)

    def _host(self, t: torch.Tensor, fill: bool):
        """(host tensor, copy-back function) for CUDA tensors; the tensor itself on CPU."""
        if t.device.type == "cpu" or self.cuda_aware:
            return t, None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if fill:
            host.copy_(t)
        return host, (lambda: t.copy_(host))

    def _cuda_ready(self, *tensors: torch.Tensor) -> Callable[[], None]:
        """Make the worker wait for the kernels that produce CUDA inputs (not the caller)."""
        if not any(t.is_cuda for t in tensors):
            return lambda: None
        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    # -- primitives -----------------------------------------------------------------------
    def _allreduce(self, buf: torch.Tensor) -> Work:
        MPI = _mpi()
        ready = self._cuda_ready(buf)
        op = _user_op(buf.dtype) if buf.dtype in (torch.float16, torch.bfloat16) else MPI.SUM

        path = self._path(buf.numel() * buf.element_size())
        seg_elems = max(1, self.segment_bytes // buf.element_size())

        def run():
            ready()
            host, back = self._host(buf, fill=True)
            data = [_numpy_view(host), _mpi_type(buf.dtype)]
            if path == "pipelined":
                block = math.ceil(host.numel() / self.size) * host.element_size()
                ring_allreduce(self.mpi_comm, host.reshape(-1), seg_elems, self._scratch(block))
            elif path == "polled":
                _wait(self.mpi_comm.Iallreduce(MPI.IN_PLACE, data, op=op))
            else:
                self.mpi_comm.Allreduce(MPI.IN_PLACE, data, op=op)
            if back:
                back()

        return self._submit(run)

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        return self._exchange_op(send, recv, send.numel() * send.element_size(), pairwise_alltoall,
                                 self.mpi_comm.Ialltoall, self.mpi_comm.Alltoall)

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        return self._exchange_op(send, recv, recv.numel() * recv.element_size(), direct_allgather,
                                 self.mpi_comm.Iallgather, self.mpi_comm.Allgather)

    def _exchange_op(self, send: torch.Tensor, recv: torch.Tensor, nbytes: int, pipelined,
                     nonblocking, blocking) -> Work:
        """An all-to-all style collective on bytes by the path ``nbytes`` calls for: commopt's
        ``pipelined`` point-to-point version, MPI's ``nonblocking`` one polled, or ``blocking``."""
        ready = self._cuda_ready(send)
        path = self._path(nbytes)

        def run():
            ready()
            s, _ = self._host(send, fill=True)
            r, back = self._host(recv, fill=False)
            sv, rv = _numpy_view(s, as_bytes=True), _numpy_view(r, as_bytes=True)
            if path == "pipelined":
                pipelined(self.mpi_comm, sv, rv, self.segment_bytes)
            elif path == "polled":
                _wait(nonblocking(sv, rv))
            else:
                blocking(sv, rv)
            if back:
                back()

        return self._submit(run)

    def _broadcast(self, buf: torch.Tensor, root: int) -> Work:
        ready = self._cuda_ready(buf)

        def run():
            ready()
            host, back = self._host(buf, fill=self.rank == root)
            self.mpi_comm.Bcast(_numpy_view(host, as_bytes=True), root=root)
            if back:
                back()

        return self._submit(run)

    def _barrier(self) -> None:
        self._call(self.mpi_comm.Barrier)

    def _bcast_obj(self, obj: Any, root: int) -> Any:
        return self._call(lambda: self.mpi_comm.bcast(obj, root=root))

    def _allgather_obj(self, obj: Any) -> list:
        return self._call(lambda: self.mpi_comm.allgather(obj))

    def _split(self, color: int, key: int) -> "MPICommunicator":
        sub = self._call(lambda: self.mpi_comm.Split(color, key))
        return MPICommunicator(allreduce_grad_dtype=self.allreduce_grad_dtype, mpi_comm=sub,
                               cuda_aware=self.cuda_aware, pipeline=self.pipeline,
                               segment_bytes=self.segment_bytes,
                               pipeline_min_bytes=self.pipeline_min_bytes, _dup=False)

    def supports_sum(self, dtype: torch.dtype) -> bool:
        if dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
            return True
        # fp16/bf16: MPI's own collectives sum them with a Python reduction, better left to
        # commopt's scatter-reduce/allgather (fp32 on the side). Between nodes large buffers
        # take the pipelined ring, which adds 16-bit segments with torch (rounding once per
        # addition, as gloo and NCCL do) at full speed.
        return (dtype in (torch.float16, torch.bfloat16) and transfer_path(
            self.pipeline, 1 << 62, size=self.size, inter_size=self.inter_size,
            min_bytes=self.pipeline_min_bytes) == "pipelined")

    def finalize(self) -> None:
        self._worker.shutdown(wait=True)
        MPI = _mpi()
        if not MPI.Is_finalized() and self.mpi_comm != MPI.COMM_WORLD:
            try:
                self.mpi_comm.Free()
            except MPI.Exception:  # pragma: no cover - already freed
                pass
