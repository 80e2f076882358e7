"""Stream-ordered issue: the narrow seam between commopt's CUDA transports and CUDA streams.

The CUDA transports (``pure_nccl``, ``torch`` with the nccl backend) never hand work to a
host thread. The calling thread enqueues everything, in program order, and CUDA streams
and events carry the ordering:

1. at issue, an event is recorded on the caller's *current* stream (where the data was
   produced) and the communication stream waits on it;
2. codec kernels and NCCL calls are enqueued on the communication stream;
3. an event recorded there afterwards is the returned :class:`StreamWork`: ``wait()``
   makes the caller's current stream wait on it (the host does not block), and
   ``synchronize()`` blocks the host until the result is in memory.

Every stream and event operation goes through a :class:`CudaStreams` object. A test
substitutes :class:`commopt.comm.stream_trace.StreamTrace`, which records the same calls
(who waits on what, in which order) instead of making them, so the ordering logic is
checked on machines without a GPU.

    >>> from commopt.comm.stream_trace import StreamTrace
    >>> trace = StreamTrace()
    >>> comm_stream = trace.new_stream(None)
    >>> work = issue_after_caller(
    ...     trace, comm_stream, None, lambda: trace.enqueue(trace.current(None), "allReduce")
    ... )
    >>> work.wait()
    >>> for line in trace.lines():
    ...     print(line)
    MainThread record e1 on default:0
    MainThread wait s1:0 on e1
    MainThread use s1:0
    MainThread enqueue s1:0 allReduce
    MainThread end-use s1:0
    MainThread record e2 on s1:0
    MainThread wait default:0 on e2
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from commopt.comm.base import Work

__all__ = ["CudaStreams", "StreamWork", "issue_after_caller", "synchronize_bounded"]


class CudaStreams:
    """torch.cuda's streams and events, behind the methods the CUDA transports use."""

    def current_device(self):
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def current(self, device):
        import torch

        return torch.cuda.current_stream(device)

    def new_stream(self, device):
        import torch

        return torch.cuda.Stream(device=device)

    def record(self, stream) -> Any:
        """A new event, recorded on ``stream`` (on ``stream``'s device)."""
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def use(self, stream):
        """Context: ``stream`` is the current stream (kernels launched inside go there)."""
        import torch

        return torch.cuda.stream(stream)

    def keep(self, tensor, stream) -> None:
        """The allocator must not reuse ``tensor``'s memory before ``stream`` is done with it."""
        tensor.record_stream(stream)

    def enqueue(self, stream, what: str, fn: Callable[[int], None] | None = None) -> None:
        """Enqueue ``fn(raw stream handle)`` (an NCCL call) on ``stream``."""
        if fn is not None:
            fn(stream.cuda_stream)

    def synchronize(self, event) -> None:
        event.synchronize()

    def query(self, event) -> bool:
        return bool(event.query())

    def is_device_tensor(self, tensor) -> bool:
        return bool(tensor.is_cuda)

    def from_host(self, values, dtype, device):
        """A device tensor of ``values`` (host numbers), copied without blocking the host.

        A plain ``torch.tensor(values, device=cuda)`` copies from pageable memory and then
        synchronizes the stream; staging in pinned memory lets the copy run in stream order.
        """
        import torch

        staged = torch.tensor(values, dtype=dtype, pin_memory=True)
        return staged.to(device, non_blocking=True)

    def to_host(self, tensor):
        """``(host_copy, event)``: ``tensor`` copied to pinned host memory in stream order.

        The copy is enqueued on the current stream and returns at once; the host may read
        ``host_copy`` only after ``synchronize(event)``.
        """
        import torch

        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host, self.record(torch.cuda.current_stream(tensor.device))


class StreamWork(Work):
    """Completion of stream-ordered work: an event on the stream that ran it.

    ``wait()`` returns at once on the host; every kernel the caller enqueues afterwards on
    its current stream (of the event's device) runs after the work, so it sees the result.
    ``synchronize()`` blocks the host until the result is in memory (e.g. before ``.tolist()``
    on another stream's data or timing).
    """

    def __init__(self, streams, event, device, stream):
        self._streams = streams
        self._event = event
        self._device = device
        self._stream = stream  # where the work ran: already ordered after it

    def wait(self) -> None:
        current = self._streams.current(self._device)
        if current != self._stream:
            self._streams.wait(current, self._event)

    def synchronize(self) -> None:
        self._streams.synchronize(self._event)

    def is_completed(self) -> bool:
        return self._streams.query(self._event)


def issue_after_caller(
    streams, comm_stream, device, fn: Callable[[], None], keep: Iterable = ()
) -> StreamWork:
    """Run ``fn`` (which enqueues kernels) with ``comm_stream`` current, after the caller's work.

    The caller's current stream is recorded first, the communication stream waits on that
    event, then ``fn`` enqueues its work; ``keep``'s tensors stay allocated until
    ``comm_stream`` is done with them. When the caller already runs on ``comm_stream``
    (nested issue), no event is needed: one stream is ordered by itself.
    """
    caller = streams.current(device)
    if caller != comm_stream:
        streams.wait(comm_stream, streams.record(caller))
    with streams.use(comm_stream) if caller != comm_stream else contextlib.nullcontext():
        fn()
        for t in keep:
            streams.keep(t, comm_stream)
    return StreamWork(streams, streams.record(comm_stream), device, comm_stream)


def synchronize_bounded(
    work: StreamWork, limit_s: float, check: Callable[[], None] | None = None
) -> bool:
    """``work.synchronize()`` that gives up after ``limit_s`` seconds; False when it did.

    Polls the event (sleeps from 0.1 ms growing to 10 ms) and calls ``check`` between
    polls, which raises on a transport's asynchronous error (a dead peer): a failed or
    silent peer cannot keep the host in ``event.synchronize()`` forever. ``inf``: no bound.
    """
    if not math.isinf(limit_s):
        deadline = time.monotonic() + limit_s
        pause = 1e-4
        while not work.is_completed():
            if check is not None:
                check()
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
    work.synchronize()
    return True
