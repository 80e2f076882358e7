"""torch.distributed transport (gloo or nccl process groups).

    $ torchrun --nproc-per-node 2 -m commopt.examples.allreduce --comm torch

Wraps the default process group, or the one given as ``group=``. When no default group
exists it is created from the launcher's environment: torchrun's MASTER_ADDR/PORT, RANK,
WORLD_SIZE; under mpirun or srun without MASTER_ADDR, rank 0's address and a free port
are shared over MPI. The backend is nccl when CUDA is available, else gloo (``backend=``
overrides).

Threads: operations are queued on the process group's own threads (gloo) or CUDA stream
(nccl) in issue order; the public methods may be called from any thread, but all ranks
must issue operations in the same order. With nccl the communicator is stream-ordered
(``stream_ordered``, see :mod:`commopt.comm.streams`): torch's ProcessGroupNCCL enqueues on
its stream after the caller's current stream, ``Work.wait()`` makes the caller's current
stream wait, ``Work.synchronize()`` blocks the host, and commopt's collectives run their
codec kernels inline on the calling thread, on a side stream of this communicator.

Dtypes a backend cannot sum are summed in fp32 on a copy, which is correct but carries 32
bits (gloo in torch >= 2.1 and nccl >= 2.10 sum fp16 and bf16 themselves).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from commopt.comm.base import C10D_SUM_DTYPES, Communicator, CompletedWork, Work
from commopt.comm.launcher import detect_launcher

_DONE = CompletedWork()


class _TorchWork(Work):
    def __init__(self, work, after=None, what: str = "a collective", comm=None):
        self._work = work
        self._after = after
        self._what = what
        self._comm = comm
        self._issued = time.monotonic()

    def wait(self) -> None:
        try:
            if self._comm is not None and self._comm.backend == "gloo":
                self._comm.bounded_wait(self._work, self._what, self._issued)
            self._work.wait()
        except RuntimeError as exc:  # a peer closed its connection: say which rank left, if known
            if self._comm is not None and _is_timeout(exc):
                raise self._comm.timed_out(self._what, exc) from exc
            raise _explain_departure(exc) from exc
        if self._after is not None:
            after, self._after = self._after, None
            after()

    def synchronize(self) -> None:
        self.wait()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # nccl's wait() only ordered the current stream: block the host on it as well.
            torch.cuda.current_stream().synchronize()

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _is_timeout(exc: RuntimeError) -> bool:
    text = str(exc)
    return "Timed out" in text or "timed out" in text or "Timeout" in text


#: Seconds every rank waits for the others to reach the rendezvous (store connect and join).
RENDEZVOUS_TIMEOUT_ENV = "COMMOPT_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_S = 30.0


def rendezvous_timeout(value: float | None = None) -> float:
    """``value``, else $COMMOPT_RENDEZVOUS_TIMEOUT, else 30 s."""
    if value is None:
        raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, "")
        try:
            value = float(raw) if raw else DEFAULT_RENDEZVOUS_S
        except ValueError:
            raise ValueError(f"{RENDEZVOUS_TIMEOUT_ENV}={raw!r}: give seconds, e.g. 30") from None
    if value <= 0:
        raise ValueError(f"the rendezvous timeout must be positive seconds, got {value}")
    return float(value)


#: The process group's timeout when there is no bound (torch needs a finite one): a year.
_UNBOUNDED = datetime.timedelta(days=365)


def init_default_group(
    backend: str | None = None,
    timeout_s: float = 600,
    rendezvous_timeout_s: float | None = None,
) -> None:
    """Create torch.distributed's default group from the launcher's environment.

    The ranks first meet in a TCP store (rank 0 hosts it, listening on MASTER_ADDR only;
    under torchrun its agent does) and every rank registers there: a rank that is missing
    after ``rendezvous_timeout_s`` (default 30 s) ends the others with its number, instead
    of leaving them in the group's creation for the collective ``timeout_s``.

    ``timeout_s`` becomes the group's timeout (``inf``: none). gloo bounds each wait of its
    algorithms by it; nccl's watchdog aborts a collective that runs longer, and with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (set here unless already set) ends the process.
    """
    if dist.is_initialized():
        return
    info = detect_launcher()
    env = os.environ
    if "MASTER_ADDR" not in env:
        if info.is_mpi or info.name == "slurm":
            _share_master_over_mpi()
        elif info.size == 1:
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", str(_free_port()))
        else:
            raise RuntimeError(
                "the 'torch' communicator needs MASTER_ADDR and MASTER_PORT (torchrun sets them); "
                "launch with torchrun, mpirun or `commopt launch --launcher torch`"
            )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    store = rendezvous_store(
        info.rank,
        info.size,
        env["MASTER_ADDR"],
        int(env.get("MASTER_PORT", "0")),
        rendezvous_timeout(rendezvous_timeout_s),
    )
    # torchrun's agent keeps its store across restarts: each attempt's group keys apart.
    store = dist.PrefixStore(f"commopt/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(
        backend,
        store=store,
        rank=info.rank,
        world_size=info.size,
        timeout=_UNBOUNDED if math.isinf(timeout_s) else datetime.timedelta(seconds=timeout_s),
    )
    # A group left alive at interpreter exit can abort the process in torch's destructors
    # ("terminate called without an active exception"): destroy the one we created.
    atexit.register(_destroy_default_group)
    global _left_store
    _left_store = (dist.PrefixStore("commopt-left", store), info.rank)
    _install_exit_on_error()


def _install_exit_on_error() -> None:
    """An uncaught exception ends this rank at once, as the mpi backend's MPI_Abort does.

    Otherwise shutdown would wait for reductions still queued (the step's trailer) whose
    peers are gone: gloo does not fail an operation on a connection that closed before it
    started, so the rank, and the ranks waiting for it, would hang.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if dist.is_initialized() and dist.get_world_size() > 1:
            _note_departure(f"raised {exc_type.__name__}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    sys.excepthook = hook


def rendezvous_store(rank: int, size: int, addr: str, port: int, wait_s: float):
    """The store every rank reached, once all ``size`` ranks have registered in it."""
    from commopt.comm.errors import CommError

    where = f"{addr}:{port}"
    limit = datetime.timedelta(seconds=wait_s)
    hint = f"(${RENDEZVOUS_TIMEOUT_ENV} sets how long to wait, now {wait_s:g}s)"
    # Under torchrun (TORCHELASTIC_USE_AGENT_STORE) the agent already serves the store.
    host_it = rank == 0 and env_flag("TORCHELASTIC_USE_AGENT_STORE") is not True
    try:
        listener = _listen(addr, port) if host_it else None
        if listener is not None:
            # The store takes the socket over (and closes it): Python must not close it too.
            store = dist.TCPStore(
                addr,
                port,
                size,
                True,
                timeout=limit,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
        elif host_it:  # MASTER_ADDR names no interface here (a NAT or service address)
            store = dist.TCPStore(addr, port, size, True, timeout=limit, wait_for_workers=False)
        else:
            store = dist.TCPStore(addr, port, size, False, timeout=limit)
    except OSError as exc:
        raise CommError(
            f"rank {rank}: cannot listen on the rendezvous address {where} "
            f"(MASTER_ADDR/MASTER_PORT): {exc}. Give an address of this host and "
            f"a free port."
        ) from None
    except RuntimeError as exc:
        raise CommError(
            f"rank {rank}: could not reach the torch.distributed rendezvous at {where} within "
            f"{wait_s:g}s: rank 0 (or torchrun's agent) hosts it there. Is rank 0 running, and "
            f"are MASTER_ADDR/MASTER_PORT its address? {hint} [{str(exc).splitlines()[0]}]"
        ) from None
    # Elastic restarts reuse the agent's store: keys of an earlier attempt must not count.
    joined = dist.PrefixStore(
        f"commopt-join/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
    )
    joined.set(f"rank{rank}", "1")
    # Rank 0 judges (it waits for every rank) and posts the verdict; the others read it, so
    # every rank's error names the same missing ranks.
    if rank == 0:
        try:
            joined.wait([f"rank{r}" for r in range(size)], limit)
            verdict = "ok"
        except RuntimeError:
            verdict = ",".join(str(r) for r in range(size) if not joined.check([f"rank{r}"]))
        joined.set("verdict", verdict)
        if verdict != "ok":  # keep the store up until the others have read it (briefly)
            present = [r for r in range(1, size) if str(r) not in verdict.split(",")]
            with contextlib.suppress(RuntimeError):
                joined.wait([f"read{r}" for r in present], datetime.timedelta(seconds=5))
    else:
        try:
            joined.wait(["verdict"], limit + datetime.timedelta(seconds=10))
            verdict = joined.get("verdict").decode()
        except RuntimeError:
            raise CommError(
                f"rank {rank}: the rendezvous at {where} closed or went silent while "
                f"this rank waited for the others: rank 0, which hosts it, ended "
                f"{hint}"
            ) from None
        if verdict != "ok":
            joined.set(f"read{rank}", "1")
    if verdict != "ok":
        raise CommError(
            f"rank {rank}: ranks [{verdict}] of {size} did not reach the rendezvous at {where} "
            f"within {wait_s:g}s (they ended before creating their communicator, or never "
            f"started) {hint}"
        )
    return store


def env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value is None else value.strip().lower() in ("1", "true", "yes")


def _listen(addr: str, port: int):
    """A socket listening on ``addr`` only; None when ``addr`` is not an address of this host.

    In that case (a service or NAT address, as on Kubernetes) the store listens on every
    interface, as torch does, and says so.
    """
    import errno
    import socket
    import sys

    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(256)
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRNOTAVAIL:
            raise
        print(
            f"commopt: MASTER_ADDR {addr} is not an address of this host; the rendezvous "
            f"store listens on every interface, port {port}",
            file=sys.stderr,
            flush=True,
        )
        return None
    return sock


#: (store, rank) of the group created here: a leaving rank notes there that, and why, it left.
_left_store = None


def _note_departure(
    why: str = "ended without an error: its script returned or called sys.exit",
) -> None:
    """Tell the peers, through the rendezvous store, that this rank is leaving and why."""
    if _left_store is None:
        return
    store, rank = _left_store
    with contextlib.suppress(Exception):  # rank 0's store may be gone already
        store.set(f"rank{rank}", why)


def _explain_departure(exc: RuntimeError) -> Exception:
    """``exc``, or a CommError naming the ranks that left (read from the store) if any did."""
    from commopt.comm.errors import CommError

    if _left_store is None or (
        "closed by peer" not in str(exc) and "Connection reset" not in str(exc)
    ):
        return exc
    store, rank = _left_store
    size = dist.get_world_size() if dist.is_initialized() else 0
    left = {}
    try:
        for r in range(size):
            if r != rank and store.check([f"rank{r}"]):
                left[r] = store.get(f"rank{r}").decode()
    except Exception:  # rank 0 hosts the store: it is the one that left
        left = {0: "left (its rendezvous store is gone with it)"}
    if not left:
        return exc
    who = "; ".join(f"rank {r} {why}" for r, why in sorted(left.items()))
    return CommError(
        f"rank {rank}: a collective failed because another rank left the job ({who}) while this "
        f"rank still waited for it. Every rank must make the same collective calls: ranks "
        f"that run out of data early keep stepping inside `with commopt.Join(optimizer):`. "
        f"[{str(exc).splitlines()[0][:200]}]"
    )


def _destroy_default_group() -> None:
    _note_departure()
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # best effort at exit
            dist.destroy_process_group()


def _free_port(addr: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _share_master_over_mpi() -> None:
    """Under mpirun/srun without torchrun: rank 0 picks the address and port, MPI shares them."""
    import socket

    from commopt.comm.mpi import _mpi

    world = _mpi().COMM_WORLD
    # A fixed 256-byte buffer (Bcast), not mpi4py's pickling bcast: "address port", padded.
    buf = bytearray(256)
    if world.Get_rank() == 0:
        ifname = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("COMMOPT_DATA_IFNAME")
        addr = _address_of(ifname) if ifname else socket.gethostbyname(socket.gethostname())
        text = f"{addr} {_free_port(addr)}".encode()
        buf[: len(text)] = text
    world.Bcast(buf, root=0)
    addr, port = bytes(buf).rstrip(b"\0").decode().split()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(int(port))


def _address_of(ifname: str) -> str:
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(
            s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode())
        )  # SIOCGIFADDR
    return socket.inet_ntoa(packed[20:24])


class TorchCommunicator(Communicator):
    """Communicator over a torch.distributed process group.

    Options: ``group`` (a ProcessGroup; default: the default group, created if needed),
    ``backend`` ("gloo" or "nccl", used only when the default group is created here),
    ``timeout`` (seconds; default $COMMOPT_COMM_TIMEOUT or 600: the timeout of a group
    created here, see :func:`init_default_group`; ``timeout_s`` is its older name),
    ``rendezvous_timeout_s`` (how long ranks wait for each other when the group is created
    here; default $COMMOPT_RENDEZVOUS_TIMEOUT or 30 s).

    A collective that times out raises :class:`~commopt.comm.errors.CommError` naming the
    collective and its peers (gloo does not say which peer was silent); uncaught, it ends
    the rank at once, and its peers' own timeouts end them.
    """

    name = "torch"

    def __init__(
        self,
        *,
        allreduce_grad_dtype: torch.dtype | None = None,
        group=None,
        backend: str | None = None,
        timeout: float | str | None = None,
        timeout_s: float | None = None,
        rendezvous_timeout_s: float | None = None,
        _order: list[int] | None = None,
    ):
        from commopt.comm.timeout import comm_timeout

        super().__init__(allreduce_grad_dtype=allreduce_grad_dtype)
        self.timeout = comm_timeout(timeout if timeout is not None else timeout_s)
        self._progress = 0.0  # when this communicator last saw a collective complete
        if group is None:
            init_default_group(backend, self.timeout, rendezvous_timeout_s)
        self.group = group
        self.backend = dist.get_backend(group)
        # Where bcast_obj/allgather_obj stage their bytes: nccl moves CUDA tensors only.
        self.object_device = "cuda" if self.backend == "nccl" else "cpu"
        self.size = dist.get_world_size(group)
        self.stream_ordered = self.backend == "nccl"
        self._codec_streams: dict = {}
        self._perms: dict[torch.device, torch.Tensor] = {}  # the alltoall's index, per device
        if self.stream_ordered:
            from commopt.comm.streams import CudaStreams

            self.streams = CudaStreams()
        # torch numbers a group's members by global rank; split() may ask for another order
        # (by key). _order[i] is the group rank of our rank i; identity in the common case.
        self._order = list(range(self.size)) if _order is None else list(_order)
        self._identity = self._order == list(range(self.size))
        self.rank = self._order.index(dist.get_rank(group))
        # Global rank of each of our ranks, for src arguments.
        self._global = [
            dist.get_global_rank(group, g) if group is not None else g for g in self._order
        ]
        self._init_topology()

    def timed_out(self, what: str, exc: BaseException) -> Exception:
        """The error for ``what`` running into the process group's timeout."""
        from commopt.comm.errors import CommError
        from commopt.comm.timeout import COMM_TIMEOUT_ENV

        peers = ", ".join(str(g) for i, g in enumerate(self._global) if i != self.rank)
        return CommError(
            f"rank {self._global[self.rank]}: {what} over {self.backend} made no progress for "
            f"{self.timeout:g}s: waiting for rank(s) {peers}"
            + (f" ({self.backend} does not say which)" if self.size > 2 else "")
            + ": the link is down, or a peer stopped or never entered this collective "
            f"(${COMM_TIMEOUT_ENV} or create_communicator(timeout=) sets the limit). "
            f"[{str(exc).splitlines()[0][:200]}]"
        )

    def bounded_wait(self, work, what: str, issued: float) -> None:
        """Poll gloo's ``work`` until done; raise when this communicator saw no collective
        complete for the timeout (counted from ``issued`` at the earliest).

        gloo's own timeout bounds the waits inside its algorithms, but a peer whose link went
        down silently can leave it waiting past that; this bound holds regardless.
        """
        if math.isinf(self.timeout):
            return
        pause = 1e-4
        while not work.is_completed():
            if time.monotonic() - max(issued, self._progress) > self.timeout:
                raise self.timed_out(what, TimeoutError("no collective completed"))
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        self._progress = time.monotonic()

    def _work(self, work, what: str, nbytes: int, after=None) -> _TorchWork:
        return _TorchWork(work, after, f"{what} of {nbytes} bytes", self)

    def codec_stream(self, device=None):
        """nccl: the side stream commopt's collectives run their codec kernels on (per device)."""
        device = torch.device("cuda") if device is None else torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = self._codec_streams.get(device)
        if stream is None:
            stream = self._codec_streams[device] = self.streams.new_stream(device)
        return stream

    # gloo (torch >= 2.1) and nccl (>= 2.10) both sum fp16 and bf16 in C++/CUDA.
    def supports_sum(self, dtype: torch.dtype) -> bool:
        return dtype in C10D_SUM_DTYPES

    def _allreduce(self, buf: torch.Tensor) -> Work:
        nbytes = buf.numel() * buf.element_size()
        if self.supports_sum(buf.dtype):
            return self._work(
                dist.all_reduce(buf, group=self.group, async_op=True), "allreduce", nbytes
            )
        wide = buf.float()
        return self._work(
            dist.all_reduce(wide, group=self.group, async_op=True),
            "allreduce",
            nbytes,
            after=lambda: buf.copy_(wide),
        )

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        if self.size == 1:
            recv.copy_(send)
            return _DONE
        s, r = _as_bytes(send), _as_bytes(recv)
        if self._identity:
            return self._work(
                dist.all_to_all_single(r, s, group=self.group, async_op=True), "alltoall", s.numel()
            )
        # Reorder chunks from our rank order to the group's, and back on arrival.
        s_chunks, r_chunks = s.view(self.size, -1), r.view(self.size, -1)
        perm = self._permutation(s.device)
        s_group = s_chunks[perm].contiguous().view(-1)
        r_group = torch.empty_like(s_group)
        return self._work(
            dist.all_to_all_single(r_group, s_group, group=self.group, async_op=True),
            "alltoall",
            s.numel(),
            after=lambda: r_chunks.index_copy_(0, perm, r_group.view(self.size, -1)),
        )

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Work:
        s, r = _as_bytes(send), _as_bytes(recv)
        if s.numel() == 0:
            return _DONE
        # Views of recv's chunks, in the group's order: all_gather writes straight into them.
        chunks = r.view(self.size, -1).unbind(0)
        outputs = [chunks[ours] for ours in self._group_to_ours()]
        return self._work(
            dist.all_gather(outputs, s, group=self.group, async_op=True), "allgather", r.numel()
        )

    def _broadcast(self, buf: torch.Tensor, root: int) -> Work:
        b = _as_bytes(buf)
        if b.numel() == 0:
            return _DONE
        return self._work(
            dist.broadcast(b, src=self._global[root], group=self.group, async_op=True),
            f"broadcast from rank {self._global[root]}",
            b.numel(),
        )

    def _barrier(self) -> None:
        try:
            dist.barrier(group=self.group)
        except RuntimeError as exc:
            if _is_timeout(exc):
                raise self.timed_out("barrier", exc) from exc
            raise _explain_departure(exc) from exc

    # bcast_obj/allgather_obj: the base class's JSON + bytes path over _broadcast/_allgather
    # (torch's *_object helpers pickle what peers send), on the device the backend moves.

    def _split(self, color: int, key: int) -> TorchCommunicator:
        # new_group must be called by every rank of the parent for every new group.
        triples = self._allgather_obj((color, key, self.rank))
        mine, order = None, None
        for c in sorted({t[0] for t in triples}):
            by_key = [self._global[r] for _, _, r in sorted(t for t in triples if t[0] == c)]
            g = dist.new_group(sorted(by_key), backend=self.backend)
            if c == color:
                mine = g
                order = [sorted(by_key).index(glob) for glob in by_key]
        return TorchCommunicator(
            allreduce_grad_dtype=self.allreduce_grad_dtype,
            group=mine,
            timeout=self.timeout,
            _order=order,
        )

    def _permutation(self, device: torch.device) -> torch.Tensor:
        """``_group_to_ours()`` as an index tensor on ``device`` (built once per device)."""
        perm = self._perms.get(device)
        if perm is None:
            perm = self._perms[device] = torch.tensor(self._group_to_ours(), device=device)
        return perm

    def _group_to_ours(self) -> list[int]:
        """Our rank of each group rank."""
        inverse = [0] * self.size
        for ours, g in enumerate(self._order):
            inverse[g] = ours
        return inverse


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
