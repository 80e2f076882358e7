"""The reduction counter: numbers each step's reduction and runs the start callbacks.

A *reduction* is one step's gradients on their way to the average; its number keys the
codecs' random numbers (stochastic rounding), so every rank must count alike. A reduction
that every rank skipped (NaN/Inf somewhere) gives its number back, and the counter goes on
from the number the reducer used. Callbacks registered with :meth:`on_start` run before each
reduction's first bucket (``commopt.Join`` counts the ranks that still have data there).

    >>> import torch, commopt
    >>> from commopt.reducer import GradientReducer
    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.ones(2)
    >>> reducer = GradientReducer(commopt.create_communicator("local"), [w], ["w"])
    >>> counter = ReductionCounter()
    >>> handle = counter.on_start(lambda: print("starting"))
    >>> counter.start(reducer).number, counter.next
    starting
    (0, 1)
    >>> handle.remove(); counter.start(reducer).number
    1
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from commopt.reducer import GradientReducer, StepReduction

__all__ = ["ReductionCounter", "StartCallbacks"]


class ReductionCounter:
    """The number of the next reduction, and the callbacks run as each one starts."""

    def __init__(self) -> None:
        self.next = 0  # the number the next reduction asks for
        self._callbacks: OrderedDict[int, Callable[[], None]] = OrderedDict()

    def on_start(self, callback: Callable[[], None]) -> RemovableHandle:
        """Run ``callback()`` as each reduction starts; ``handle.remove()`` stops it."""
        handle = RemovableHandle(self._callbacks)
        self._callbacks[handle.id] = callback
        return handle

    def start(
        self, reducer: GradientReducer, *, scale: float | torch.Tensor = 1.0, buffer: int = 0
    ) -> StepReduction:
        """Start the next reduction of ``reducer``'s buckets into buffer set ``buffer``."""
        self.run_start_callbacks()
        red = reducer.start(number=self.next, buffer=buffer, scale=scale)
        self.next = red.number + 1  # a reduction every rank skipped gave its number back
        return red

    def run_start_callbacks(self) -> None:
        """Run the :meth:`on_start` callbacks (as a reduction starts)."""
        for callback in list(self._callbacks.values()):
            callback()

    def saved(self, reducer: GradientReducer) -> int:
        """The number to save in a checkpoint (the skipped steps' numbers given back)."""
        return self.next - reducer.pending_discards


class StartCallbacks:
    """The callbacks run once a step, as the first reduction of the step starts.

    The optimizer's ``on_reduction_start`` registers here (``commopt.Join`` counts the ranks
    that still have data); every part's :class:`ReductionCounter` calls :meth:`starting`,
    and :meth:`step_done` arms them again for the next step.

        >>> calls = StartCallbacks()
        >>> handle = calls.add(lambda: print("first reduction of the step"))
        >>> calls.starting(); calls.starting()
        first reduction of the step
        >>> calls.step_done(); calls.starting()
        first reduction of the step
    """

    def __init__(self) -> None:
        self._callbacks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self._ran = False  # this step's first reduction started

    def add(self, callback: Callable[[], None]) -> RemovableHandle:
        handle = RemovableHandle(self._callbacks)
        self._callbacks[handle.id] = callback
        return handle

    def starting(self) -> None:
        if not self._ran:
            self._ran = True
            for callback in list(self._callbacks.values()):
                callback()

    def step_done(self) -> None:
        self._ran = False
