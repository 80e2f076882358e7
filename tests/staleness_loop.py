"""The compensated delayed loop (``LocalStepPrediction``'s contract), written out for the tests.

The tests hold the wrapper, and synchronous training, against this hand-written loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from commopt.optim.staleness import LocalStepPrediction


def compensated_by_hand(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    grads: Callable[[int], list[torch.Tensor]],
    steps: int,
) -> None:
    """``steps`` delayed steps with prediction (``grads(step)``: the local gradients), flushed."""
    comp, pending = LocalStepPrediction(opt), None
    for step in range(steps):
        local = grads(step)
        if pending is not None:
            for p, a in zip(model.parameters(), pending):
                p.grad = a
            comp.restore()
            opt.step()
        comp.predict(local)
        pending = local
    comp.restore()
    for p, a in zip(model.parameters(), pending):  # flush()
        p.grad = a
    opt.step()
