"""What the backward hooks, ``synchronize()`` and ``step()`` do without double buffering.

The step in progress is a :class:`~commopt.optim.step_state.StepState` (``opt._step``);
these functions send it its events. With ``overlap=True`` each hook marks its gradient
ready and the reduction sends every bucket whose gradients are all in
(:func:`grad_ready`); the end of backward finishes the reduction (:func:`synchronize`), so
``backward()`` returns with the averages in ``param.grad``, as under DDP. With
``overlap=False`` the gradients stay local until ``step()`` or ``synchronize()`` sends them.
:func:`step` applies the averages (or skips the step every rank skips).

    >>> import torch, commopt
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = commopt.create_multi_node_optimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1), commopt.create_communicator("local"),
    ...     overlap=False,
    ... )
    >>> model(torch.ones(1, 2)).sum().backward(); opt._step.stage.value
    'local'
    >>> synchronize(opt); opt._step.stage.value
    'averaged'
    >>> step(opt); opt._step.stage.value, opt.applied_steps
    ('idle', 1)
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from commopt.optim.apply_step import apply_result
from commopt.optim.step_state import Stage

if TYPE_CHECKING:
    from commopt.optim.multi_node import MultiNodeOptimizer

__all__ = ["grad_ready", "step", "synchronize"]


def grad_ready(opt: MultiNodeOptimizer, index: int) -> None:
    """Backward produced parameter ``index``'s gradient (outside ``no_sync()``)."""
    state = opt._step
    state.wrote()
    if not opt.overlap:
        return
    if state.in_flight is None:
        if state.averages is not None and _adds_to_averages(opt, index):
            # The averages were not applied (GradScaler skipped the step) and this backward
            # adds to them; a gradient set to None (model.zero_grad()) starts afresh.
            raise RuntimeError(
                "a second backward() before step(): the gradients of the first were averaged "
                "already. Call optimizer.zero_grad() between steps; for gradient accumulation, "
                "run all but the last backward inside `with optimizer.no_sync():`."
            )
        state.drop()
        state.send(opt._start())
    red = state.in_flight
    assert red is not None  # (sent just above)
    red.mark_ready(index)
    if red.issued == len(opt._layout.buckets) and not opt._hooks.end_queued:
        # Every gradient is in, though inside a nested (reentrant checkpoint) backward:
        # finishing at its end is safe, as DDP's reducer does.
        opt._hooks.queue_end()


def _adds_to_averages(opt: MultiNodeOptimizer, index: int) -> bool:
    """Whether parameter ``index``'s gradient is still the tensor synchronize() left."""
    ref = opt._averaged[index] if index < len(opt._averaged) else None
    grad = opt._layout.params[index].grad
    return ref is not None and grad is not None and ref() is grad


def synchronize(opt: MultiNodeOptimizer) -> None:
    """Finish this step's reduction (or send it all now): the averages land in ``param.grad``."""
    state = opt._step
    if state.stage is Stage.AVERAGED:
        return  # already averaged since the last backward
    opt._ensure_layout()
    red = state.collect()  # the one the hooks are sending, if any
    if red is None:
        red = opt._start()
    red.issue_remaining()
    red.unpack(opt.zero_fill)
    state.averaged(red)
    opt._averaged = [  # (the second-backward check)
        None if p.grad is None else weakref.ref(p.grad) for p in opt._layout.params
    ]


def step(opt: MultiNodeOptimizer) -> None:
    """Average this step's gradients unless ``synchronize()`` did; apply them."""
    if opt._step.stage is not Stage.AVERAGED:
        if opt._skip_sync:
            raise opt._not_synchronized_error()
        opt._check_no_local_writes()
        opt.synchronize()
    apply_result(opt, opt._step.take().wait())
