"""The optimizer's hooks into autograd: one per parameter, and one callback per backward.

Each trainable parameter gets a post-accumulate-grad hook that tells the optimizer
"gradient ``index`` is ready" (``owner._on_grad_ready(index)``); the first of a backward
queues autograd's final callback (``owner._backward_done()``), which runs once the whole
backward has produced its gradients: DDP's contract that the averages are in ``.grad``
when ``backward()`` returns. The hooks hold the optimizer weakly: a dropped optimizer is
collected even while its hooks stay on the parameters.

    >>> import torch
    >>> class Owner:
    ...     def __init__(self):
    ...         self.events = []
    ...         self.hooks = BackwardHooks(self)
    ...
    ...     def _on_grad_ready(self, index):
    ...         self.events.append(index)
    ...         self.hooks.queue_end_of_backward()
    ...
    ...     def _backward_done(self):
    ...         self.hooks.end_queued = False
    ...         self.events.append("done")
    >>> w = torch.nn.Parameter(torch.ones(2)); b = torch.nn.Parameter(torch.ones(2))
    >>> owner = Owner(); owner.hooks.attach([w, b])
    >>> (w * b).sum().backward()
    >>> sorted(owner.events[:2]), owner.events[2:]  # each gradient, then the end (once)
    ([0, 1], ['done'])
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["BackwardHooks", "in_nested_backward"]


class BackwardHooks:
    """The per-parameter hooks of one optimizer and its once-per-backward final callback."""

    def __init__(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)
        self._handles: list = []
        self.end_queued = False  # the end-of-backward callback is queued

    def attach(self, params: Sequence[torch.Tensor]) -> None:
        """Hook ``params`` (in place of any earlier hooks): ``params[i]`` reports index ``i``."""
        self.remove()
        self._handles = [
            p.register_post_accumulate_grad_hook(_GradReady(self._owner, i))
            for i, p in enumerate(params)
        ]

    def remove(self) -> None:
        """Detach every hook."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def queue_end_of_backward(self) -> None:
        """Queue the owner's ``_backward_done`` unless queued, or inside a nested backward."""
        if not self.end_queued and not in_nested_backward():
            self.queue_end()

    def queue_end(self) -> None:
        """Queue the owner's ``_backward_done`` at the end of the backward running now."""
        owner = self._owner()
        if owner is None:
            return
        self.end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(owner._backward_done)


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


class _GradReady:
    """Backward hook of one parameter; holds the optimizer weakly."""

    def __init__(self, owner_ref: weakref.ref, index: int):
        self._owner_ref = owner_ref
        self._index = index

    def __call__(self, param: torch.Tensor) -> None:
        owner = self._owner_ref()
        if owner is not None:
            owner._on_grad_ready(self._index)
