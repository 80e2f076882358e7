"""A recorder of stream and event calls, for testing the ordering logic of the CUDA path.

:class:`StreamTrace` has the methods of :class:`commopt.comm.streams.CudaStreams`; a CUDA
transport given one (``_streams=``) records what it would ask CUDA to do instead of doing
it: which event is recorded on which stream, which stream waits on which event, what is
enqueued where, from which host thread, in which order. No kernel runs and no byte moves:
this is a test of ordering logic, not a transport (the real transport runs in tests/gpu).

As in CUDA, the current stream is per host thread and per device: a thread that never
selected one sees the device's default stream.

It also records *host reads*: inside :meth:`StreamTrace.host_reads`, every ``.item()``,
``bool()``, ``float()``, ``int()``, ``.tolist()``, ``.cpu()`` and ``.numpy()`` of a tensor is
logged as ``host-read`` with the line of commopt that made it. Every tensor stands for device
memory here (as :meth:`StreamTrace.is_device_tensor` says), except the host copies that
:meth:`StreamTrace.to_host` hands out: on a GPU each logged read would block the host until
the streams reached that value, so a read logged while a reduction is in flight is a lost
overlap.

    >>> trace = StreamTrace()
    >>> side = trace.new_stream(None)
    >>> trace.current(None).name, side.name
    ('default:0', 's1:0')
    >>> with trace.use(side):
    ...     trace.current(None).name
    's1:0'
    >>> ev = trace.record(side); trace.wait(trace.current(None), ev)
    >>> trace.lines()
    ['MainThread use s1:0', 'MainThread end-use s1:0', 'MainThread record e1 on s1:0', 'MainThread wait default:0 on e1']
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from types import FrameType

import torch

__all__ = ["HOST_READS", "StreamTrace", "TraceEvent", "TraceStream"]

#: The tensor methods that hand a value to the host (on CUDA: wait for the stream first).
HOST_READS = frozenset(
    {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"}
)
_COMMOPT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class TraceStream:
    name: str
    device: int


@dataclass(frozen=True)
class TraceEvent:
    name: str
    stream: TraceStream


@dataclass
class StreamTrace:
    """Records stream/event calls as ``(op, thread, *args)`` tuples in :attr:`ops`."""

    device: int = 0
    ops: list = field(default_factory=list)
    #: the unique id each NCCL communicator was created with (as the bootstrap delivered it)
    unique_ids: list = field(default_factory=list)

    def __post_init__(self):
        self._ids = itertools.count(1)
        self._events = itertools.count(1)
        self._local = threading.local()
        self._lock = threading.Lock()
        # to_host's copies (real host memory), by id: a WeakSet would compare tensors by value
        self._host: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def _log(self, *entry) -> None:
        with self._lock:
            self.ops.append((entry[0], threading.current_thread().name, *entry[1:]))

    def _index(self, device) -> int:
        if device is None:
            return getattr(self._local, "device", self.device)
        index = getattr(device, "index", device)
        return self.device if index is None else int(index)

    # -- the CudaStreams methods -------------------------------------------------------
    def current_device(self):
        return self._index(None)

    def set_device(self, index: int) -> None:
        """Like torch.cuda.set_device, for the calling thread."""
        self._local.device = index

    def current(self, device) -> TraceStream:
        index = self._index(device)
        return getattr(self._local, "streams", {}).get(
            index, TraceStream(f"default:{index}", index)
        )

    def new_stream(self, device) -> TraceStream:
        index = self._index(device)
        return TraceStream(f"s{next(self._ids)}:{index}", index)

    def record(self, stream: TraceStream) -> TraceEvent:
        event = TraceEvent(f"e{next(self._events)}", stream)
        self._log("record", event.name, stream.name)
        return event

    def wait(self, stream: TraceStream, event: TraceEvent) -> None:
        self._log("wait", stream.name, event.name)

    @contextlib.contextmanager
    def use(self, stream: TraceStream):
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        previous = streams.get(stream.device)
        streams[stream.device] = stream
        self._log("use", stream.name)
        try:
            yield
        finally:
            if previous is None:
                del streams[stream.device]
            else:
                streams[stream.device] = previous
            self._log("end-use", stream.name)

    def keep(self, tensor, stream: TraceStream) -> None:
        self._log("keep", stream.name)

    def enqueue(self, stream: TraceStream, what: str, fn=None) -> None:
        self._log("enqueue", stream.name, what)  # fn is not called: nothing runs

    def synchronize(self, event: TraceEvent) -> None:
        self._log("synchronize", event.name)

    def query(self, event: TraceEvent) -> bool:
        return True

    def is_device_tensor(self, tensor) -> bool:
        return True

    def from_host(self, values, dtype, device):
        self._log("from-host", len(values))
        return torch.tensor(values, dtype=dtype)

    def to_host(self, tensor):
        host = tensor.detach().clone()
        self._host[id(host)] = host
        event = self.record(self.current(None))
        self._log("to-host", event.name)
        return host, event

    # -- host reads -------------------------------------------------------------------------
    @contextlib.contextmanager
    def host_reads(self):
        """Log every host read of a (device-standing) tensor made inside, with its commopt line.

        The read methods of ``torch.Tensor`` are wrapped for the duration, for every thread:
        a torch function mode would not see the reads made in autograd's hooks and callbacks.
        """
        trace = self
        originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

        def wrap(name, method):
            def read(tensor, *args, **kwargs):
                if trace._host.get(id(tensor)) is not tensor:
                    trace._log("host-read", name, _commopt_caller())
                return method(tensor, *args, **kwargs)

            return read

        for name, method in originals.items():
            setattr(torch.Tensor, name, wrap(name, method))
        try:
            yield
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)

    def mark(self, label: str) -> None:
        """A labelled point in the trace (a test's own phases: "backward", "step", ...)."""
        self._log("mark", label)

    # -- NCCL communicator lifetime (recorded, never created) ----------------------------
    def nccl_unique_id(self) -> tuple:
        """A made-up NCCL unique id (128 bytes, as ncclGetUniqueId's), different per call."""
        import random

        return tuple(random.randrange(256) for _ in range(128))

    def nccl_init(self, size: int, rank: int, unique_id: tuple) -> str:
        name = f"nccl{next(self._ids)}"
        self.unique_ids.append(tuple(unique_id))
        self._log("nccl-init", name, size, rank)
        return name

    def nccl_destroy(self, comm: str) -> None:
        self._log("nccl-destroy", comm)

    # -- reading the trace ----------------------------------------------------------------
    def lines(self) -> list[str]:
        """The trace as text, one call a line: ``thread op args``."""
        out = []
        for op, thread, *args in self.ops:
            if op == "record":
                out.append(f"{thread} record {args[0]} on {args[1]}")
            elif op == "wait":
                out.append(f"{thread} wait {args[0]} on {args[1]}")
            else:
                out.append(" ".join([thread, op, *map(str, args)]))
        return out

    def of(self, op: str) -> list[tuple]:
        """The recorded calls of kind ``op`` (their arguments, thread dropped)."""
        return [tuple(args) for o, _, *args in self.ops if o == op]

    def position(self, op: str, *args) -> int:
        """Index in :attr:`ops` of the first ``op`` call with these leading arguments."""
        for i, (o, _, *a) in enumerate(self.ops):
            if o == op and tuple(a[: len(args)]) == args:
                return i
        raise AssertionError(f"no {op} {args} in the trace:\n" + "\n".join(self.lines()))

    def threads(self) -> set[str]:
        return {thread for _, thread, *_ in self.ops}


def _commopt_caller() -> str:
    """``file:line`` of the innermost commopt frame on the stack (outside this module)."""
    frame: FrameType | None = sys._getframe(2)
    here = os.path.abspath(__file__)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_COMMOPT_DIR) and path != here:
            return f"{os.path.relpath(path, os.path.dirname(_COMMOPT_DIR))}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside commopt"
