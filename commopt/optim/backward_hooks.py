"""The hooks into autograd: one per parameter, and one callback per backward.

Each trainable parameter gets a post-accumulate-grad hook that reports "gradient ``index``
is ready" (the ``on_grad_ready(index)`` callback); the receiver queues autograd's final
callback (``on_backward_end()``) with :meth:`BackwardHooks.queue_end_of_backward`, once per
backward: it runs once the whole backward has produced its gradients, DDP's contract that
the averages are in ``.grad`` when ``backward()`` returns. The hooks own whether that
callback is queued: they forget it as it runs, or when :meth:`~BackwardHooks.forget_end`
says the backward raised. Bound methods are held weakly: an optimizer that is dropped is
collected even while its hooks stay on the parameters.

    >>> import torch
    >>> events = []
    >>> class Owner:
    ...     def __init__(self):
    ...         self.hooks = BackwardHooks(self.ready, self.done)
    ...
    ...     def ready(self, index):
    ...         events.append(index)
    ...         self.hooks.queue_end_of_backward()
    ...
    ...     def done(self):
    ...         events.append("done")
    >>> w = torch.nn.Parameter(torch.ones(2)); b = torch.nn.Parameter(torch.ones(2))
    >>> owner = Owner(); owner.hooks.attach([w, b])
    >>> (w * b).sum().backward()
    >>> sorted(events[:2]), events[2:]  # each gradient, then the end (once)
    ([0, 1], ['done'])
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["BackwardHooks", "in_nested_backward"]


class BackwardHooks:
    """The per-parameter hooks of one optimizer and its once-per-backward final callback."""

    def __init__(
        self, on_grad_ready: Callable[[int], None], on_backward_end: Callable[[], None]
    ) -> None:
        self._ready = _weak(on_grad_ready)
        self._end = _weak(on_backward_end)
        self._handles: list[RemovableHandle] = []
        self._end_queued = False  # the end-of-backward callback is queued

    @property
    def end_queued(self) -> bool:
        """Whether the end-of-backward callback is queued for the backward running now."""
        return self._end_queued

    def forget_end(self) -> None:
        """A backward that raised never ran its final callback: the next one queues afresh."""
        self._end_queued = False

    def attach(self, params: Sequence[torch.Tensor]) -> None:
        """Hook ``params`` (in place of any earlier hooks): ``params[i]`` reports index ``i``."""
        self.remove()
        self._handles = [
            p.register_post_accumulate_grad_hook(_GradReady(self._ready, i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(params)
        ]

    def remove(self) -> None:
        """Detach every hook."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def queue_end_of_backward(self) -> None:
        """Queue ``on_backward_end`` unless queued, or inside a nested backward."""
        if not self._end_queued and not in_nested_backward():
            self.queue_end()

    def queue_end(self) -> None:
        """Queue ``on_backward_end`` at the end of the backward running now (unless queued;
        inside a nested backward too: the caller knows every gradient is in)."""
        if self._end_queued or self._end() is None:
            return
        self._end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._end_queued = False
        callback = self._end()
        if callback is not None:
            callback()


def in_nested_backward() -> bool:
    """Whether this hook runs in a backward started by an autograd Function's backward.

    Reentrant activation checkpointing runs such inner backward passes; a callback queued
    there would run at the end of the inner pass, before the outer one has produced the
    other gradients. Its trace is torch's trampoline for Python backward functions on this
    thread's stack (a few dozen frames, looked at once per backward).
    """
    trampoline = torch.autograd.function.BackwardCFunction.apply.__code__
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is trampoline:
            return True
        frame = frame.f_back
    return False


def _weak(callback: Callable[..., None]) -> Callable[[], Callable[..., None] | None]:
    """A weak reference to a bound method (its object may be collected), or a strong one."""
    if isinstance(callback, types.MethodType):
        return weakref.WeakMethod(callback)
    return lambda: callback


class _GradReady:
    """Backward hook of one parameter; holds its callback weakly."""

    def __init__(self, ready: Callable[[], Callable[[int], None] | None], index: int):
        self._ready = ready
        self._index = index

    def __call__(self, param: torch.Tensor) -> None:
        callback = self._ready()
        if callback is not None:
            callback(self._index)
