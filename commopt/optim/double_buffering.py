"""Double buffering: step t's reduction runs during step t+1's forward and backward.

Two sets of bucket buffers alternate: while the reduction of one set is in
flight, backward fills the other. Each exchange sends this step's gradients from the
current set and hands back the previous step's agreed result, with its averages unpacked
into ``param.grad``; the optimizer applies it (one step stale). A checkpoint keeps the
reduction still pending, so a resumed run applies exactly what the original would have.

    >>> import torch, commopt
    >>> from commopt.reducer import GradientReducer
    >>> from commopt.optim.double_buffering import DoubleBuffer
    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.ones(2)
    >>> reducer = GradientReducer(commopt.create_communicator("local"), [w], ["w"], num_buffers=2)
    >>> db = DoubleBuffer()
    >>> db.exchange(lambda buffer: reducer.start(number=0, buffer=buffer), reducer, zero_fill=True)
    >>> db.take() is None  # the first step has nothing to apply yet
    True
    >>> db.flush(zero_fill=True).nonfinite, w.grad.tolist()
    (False, [1.0, 1.0])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from commopt.reducer import GradientReducer, StepReduction, StepResult

__all__ = ["DoubleBuffer"]


class DoubleBuffer:
    """The reduction in flight between two steps, and which buffer set backward fills next."""

    def __init__(self) -> None:
        self.pending: StepReduction | None = None  # step t's reduction, applied at t+1
        self.buffer = 0  # the buffer set this step's gradients go to
        self._exchanged = False  # this step's exchange happened (synchronize() or step())
        self._result: StepResult | None = None  # what the exchange handed back to apply

    @property
    def exchanged(self) -> bool:
        """Whether this step's gradients were sent already (by ``synchronize()``)."""
        return self._exchanged

    def exchange(
        self, start: Callable[[int], StepReduction], reducer: GradientReducer, zero_fill: bool
    ) -> None:
        """Send this step's gradients (``start(buffer)``); unpack the previous step's averages."""
        previous = self.pending
        if previous is not None:
            previous.wait()  # its trailer ran on the worker: no overlap lost
        current = start(self.buffer)
        current.issue_remaining()  # packs this step's local gradients and sends every bucket
        self.pending = current
        self.buffer ^= 1
        self._exchanged = True
        if previous is None:
            self._result = None  # first step: nothing to apply yet
            return
        if previous.reducer is not reducer:
            # The parameters changed: old buckets go to their old parameters; new ones wait.
            covered = {id(p) for p in previous.reducer.params}
            for p in reducer.params:
                if id(p) not in covered:
                    p.grad = None
        self._result = previous.unpack(zero_fill)

    def take(self) -> StepResult | None:
        """The result this step applies (None: nothing yet); the next step exchanges anew."""
        result, self._result, self._exchanged = self._result, None, False
        return result

    def flush(self, zero_fill: bool) -> StepResult | None:
        """Unpack the last pending reduction and return its result (None: nothing pending)."""
        if self.pending is None:
            return None
        red, self.pending = self.pending, None
        self._result, self._exchanged = None, False
        return red.unpack(zero_fill)

    def drop(self) -> None:
        """Forget the pending reduction (its gradients are not applied)."""
        self.pending = None
        self._result, self._exchanged = None, False

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``db_buffer`` (the buffer set) and ``pending`` (the reduction in flight, completed first)."""
        return {
            "db_buffer": self.buffer,
            "pending": self.pending.state_dict() if self.pending is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], reducer: GradientReducer) -> None:
        """Restore :meth:`state_dict`'s keys; the pending reduction onto ``reducer``'s buckets."""
        self._result, self._exchanged = None, False
        pending = state.get("pending")
        if pending is None:
            self.pending = None
            return
        self.buffer = int(state["db_buffer"])
        red = StepReduction(reducer, 0, self.buffer ^ 1, 1.0)
        red.load_state_dict(pending)
        self.pending = red
