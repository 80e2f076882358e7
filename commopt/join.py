"""``Join``: ranks with uneven data finish together instead of leaving their peers waiting.

The last batch of an epoch is often missing on some ranks. Inside ``with Join(optimizer):``
every ``optimizer.step()`` first tells the others, with one small allreduce on the
optimizer's communicator, that this rank still trains. A rank whose loop has ended waits at
the end of the block and *shadows* the others: for every step they still take it joins
their reductions with zero gradients and applies the same averaged update, so its weights
stay equal to theirs. The block ends on every rank once no rank has data left.

The average is over **all** ranks (a rank that ran out contributes zeros), as PyTorch DDP's
``Join`` does by default: on a step where k of n ranks still have data, the update is k/n of
their mean gradient.

    >>> import torch, commopt
    >>> comm = commopt.create_communicator("local")
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = commopt.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    >>> with commopt.Join(opt) as join:
    ...     for x in torch.ones(3, 1, 2):  # this rank's shard: 3 batches
    ...         opt.zero_grad()
    ...         model(x).sum().backward()
    ...         opt.step()
    >>> join.shadow_steps, opt.applied_steps
    (0, 3)

Every rank must enter the block with the same optimizer, and inside it call ``step()``
once per batch (a rank that leaves the block by an exception ends the job as usual). Costs
one allreduce of one number per step inside the block.
"""

from __future__ import annotations

from typing import Self

import torch

from commopt.comm.base import scalar_device

__all__ = ["Join"]


class Join:
    """Context in which ranks that run out of data shadow the others' steps (see module)."""

    def __init__(self, optimizer):
        from commopt.optim.multi_node import MultiNodeOptimizer

        if not isinstance(optimizer, MultiNodeOptimizer):
            raise TypeError(
                "Join takes the optimizer create_multi_node_optimizer returned, got "
                f"{type(optimizer).__name__}"
            )
        local = sorted({s.name for s in optimizer.plans.values() if not s.reduces_every_step})
        if local:
            raise ValueError(
                f"Join shadows the other ranks' reductions step by step, but the {local[0]} "
                "schedule does not reduce at every step: give every rank the same number of "
                "steps (drop the last uneven batch, e.g. DataLoader(..., drop_last=True) with a "
                "DistributedSampler), or train with a schedule that reduces every step"
            )
        self.optimizer = optimizer
        self.comm = optimizer.comm
        self.shadow_steps = 0  # steps this rank took with zero gradients after its data ended
        self._shadowing = False
        self._handle = None  # the optimizer's reduction-start callback, inside the block

    def __enter__(self) -> Self:
        # The flag goes before each step's first bucket (as DDP's Join does it in forward):
        # a rank that shadows sends its flag, then its zero buckets, in the same order.
        self._handle = self.optimizer.on_reduction_start(self._training)
        return self

    def _training(self) -> None:
        self._still_training(True)

    def _still_training(self, mine: bool) -> int:
        """How many ranks still have data (a collective call, once per step on every rank)."""
        flag = torch.tensor([1.0 if mine else 0.0], device=scalar_device(self.comm))
        self.comm.allreduce(flag)
        return int(flag.item())

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._stop_counting()
            if exc_type is None:
                self._shadowing = True
                while self._still_training(False) > 0:
                    self.optimizer.zero_grad(set_to_none=True)
                    self.optimizer.step()  # zeros in, the others' average out
                    self.shadow_steps += 1
        finally:
            self._stop_counting()
            self._shadowing = False

    def _stop_counting(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
