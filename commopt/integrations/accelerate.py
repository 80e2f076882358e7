"""Hugging Face Accelerate: commopt's optimizer in an ``Accelerator`` training loop.

    from accelerate import Accelerator
    from commopt.integrations.accelerate import prepare_optimizer

    accelerator = Accelerator()  # on CPU: Accelerator(cpu=True), or it runs one process
    model, loader = accelerator.prepare(model, loader)  # the optimizer is not in this call
    model, opt = prepare_optimizer(accelerator, model, torch.optim.AdamW(model.parameters()),
                                   compression="qsgd4+ef", double_buffering=True)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y))
            opt.step(); opt.zero_grad()
    opt.optimizer.final_sync()  # double buffering: the last gradients; local steps: a sync

:func:`prepare_optimizer` takes the model as ``accelerator.prepare`` returned it and the
plain torch optimizer. It returns the model without Accelerate's DistributedDataParallel
(commopt's optimizer averages the gradients; DDP would average them a second time) and the
optimizer wrapped by :func:`commopt.create_multi_node_optimizer` and then by
``accelerator.prepare_optimizer``, so what Accelerate does around it keeps its meaning:

- ``accelerator.accumulate(model)`` and ``accelerator.no_sync(model)``: the micro-batches
  before the last accumulate locally (the model's ``no_sync`` is the optimizer's); the step
  and ``zero_grad`` run on the last one only, as Accelerate's own optimizer wrapper decides.
- mixed precision: Accelerate's ``GradScaler`` steps commopt's optimizer, which unscales and
  skips steps on every rank alike.
- ``accelerator.clip_grad_norm_`` between backward and step clips the averaged gradients in
  the default mode (``overlap=True``, no double buffering). With double buffering or
  ``overlap=False`` the gradients are still local there and commopt refuses the write,
  naming the fix: pass ``clip_grad_norm=`` here instead.
- ``accelerator.save_state`` / ``load_state``: rank 0 writes Accelerate's files and every
  rank writes its own part of commopt's state (error-feedback residuals differ per rank) as
  ``commopt_rank<R>.pt`` in the same folder; ``load_state`` gives each rank its own part.
  Where the model holds a rank's own weights between steps (compensated double buffering's
  predicted weights, local steps' local weights), Accelerate's model file is written at the
  weights the ranks agree on (``opt.true_weights()``) and each rank's part puts its own
  weights back on ``load_state``.
- local steps (``schedule="local_steps"``, ``sync_every=``, ``fragments=``,
  ``overlap_steps=``, ``outer_lr=``, DiLoCo and Streaming DiLoCo): ``accumulate`` makes one
  inner step of several micro-batches; ``accelerator.clip_grad_norm_`` (or
  ``clip_grad_norm=``) clips each rank's own gradients before its inner step, which is what
  the inner step applies; the saved part holds the anchor, the outer optimizer's state, the
  position in the cycle (a reduction in flight saved completed) and the rank's own weights,
  inner state and residuals, so ``load_state`` resumes exactly from a step inside a cycle.
  Between synchronisations each rank's model holds its own weights: evaluate inside
  ``with opt.optimizer.true_weights():`` (the anchor, the same on every rank), and end
  training with ``opt.optimizer.final_sync()`` (every rank calls it): the fragments with
  inner steps since their last synchronisation synchronise, and the model is the anchor on
  every rank (``flush()`` only applies the reductions in flight and leaves the local
  weights).

Every keyword of ``create_multi_node_optimizer`` but ``model`` is accepted; ``communicator``
(default ``"torch"``: the process group Accelerate created, gloo on CPU, nccl on GPU) and
``communicator_options`` go to :func:`commopt.create_communicator`. The returned model is
Accelerate's own module: ``accelerator.unwrap_model`` and ``get_state_dict`` work as before.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from commopt.comm import create_communicator
from commopt.optim import MultiNodeOptimizer

if TYPE_CHECKING:
    import accelerate

__all__ = ["prepare_optimizer", "rank_state_file"]


def rank_state_file(rank: int) -> str:
    """The name of rank ``rank``'s part of commopt's state in a ``save_state`` folder."""
    return f"commopt_rank{rank}.pt"


class _AccelerateStep(MultiNodeOptimizer):
    """commopt's optimizer whose ``load_state_dict`` takes this rank's own part of the state.

    Accelerate saves one optimizer state (rank 0's) and loads it on every rank; the
    ``load_state`` hook of :func:`prepare_optimizer` stages this rank's own part first.
    """

    _staged: dict[str, Any] | None = None

    def stage_rank_state(self, part: dict[str, Any] | None) -> None:
        """Use ``part`` as commopt's state at the next ``load_state_dict``."""
        self._staged = part

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._staged is not None:
            state_dict = {**state_dict, "commopt": self._staged}
            self._staged = None
        super().load_state_dict(state_dict)


def prepare_optimizer(
    accelerator: accelerate.Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    communicator: str = "torch",
    communicator_options: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[torch.nn.Module, Any]:
    """(model without DDP, Accelerate's optimizer around commopt's): see the module's doc."""
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError as exc:  # an optional integration: say how to get it
        raise ImportError(
            "commopt.integrations.accelerate needs Hugging Face Accelerate: "
            "pip install 'accelerate==1.15.0' (or pip install 'commopt[accelerate]')"
        ) from exc
    if isinstance(optimizer, AcceleratedOptimizer):
        raise TypeError(
            "prepare_optimizer takes the plain torch optimizer, not one accelerator.prepare "
            "returned: leave the optimizer out of accelerator.prepare(...) and pass it here "
            "(prepare_optimizer hands commopt's optimizer to accelerator.prepare_optimizer)"
        )
    if isinstance(optimizer, MultiNodeOptimizer):
        raise TypeError(
            "this optimizer is already wrapped by create_multi_node_optimizer: pass the plain "
            "torch optimizer; prepare_optimizer wraps it with the options given here"
        )
    if "model" in options:
        raise TypeError("prepare_optimizer passes the model itself: leave out model=")
    module = accelerator.unwrap_model(model)
    comm = create_communicator(communicator, **(communicator_options or {}))
    if comm.size != accelerator.num_processes:
        raise ValueError(
            f"the {communicator!r} communicator has {comm.size} ranks but the Accelerator "
            f"{accelerator.num_processes} process(es): each would train on its own. On CPU, "
            "Accelerate runs distributed only with Accelerator(cpu=True); otherwise pass the "
            "communicator that spans Accelerate's processes"
        )
    wrapped = _AccelerateStep(optimizer, comm, model=module, **options)
    # accelerator.accumulate()/no_sync() call the model's no_sync (DDP's, before): the
    # optimizer's, unless the module has one of its own.
    own = getattr(module, "no_sync", None)
    if own is None or isinstance(getattr(own, "__self__", None), MultiNodeOptimizer):
        module.no_sync = wrapped.no_sync
    prepared = accelerator.prepare_optimizer(wrapped)
    rank = accelerator.process_index

    def save_rank_state(models, weights, output_dir) -> None:
        os.makedirs(output_dir, exist_ok=True)
        part = wrapped.state_dict()["commopt"]  # (this rank's own weights where they differ)
        torch.save({"commopt": part}, os.path.join(output_dir, rank_state_file(rank)))
        if wrapped.holds_local_weights:
            # Accelerate's model file: the weights the ranks agree on, not rank 0's own.
            with wrapped.true_weights():
                for i, saved in enumerate(models):
                    if accelerator.unwrap_model(saved) is module and i < len(weights):
                        agreed = accelerator.get_state_dict(saved, unwrap=False)
                        weights[i] = {k: v.clone() for k, v in agreed.items()}

    def load_rank_state(models, input_dir) -> None:
        path = os.path.join(input_dir, rank_state_file(rank))
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"rank {rank}: {path} is missing; it holds this rank's part of commopt's state "
                f"(error-feedback residuals) saved with the rest of {input_dir}: load a folder "
                "written by accelerator.save_state with commopt's optimizer prepared"
            )
        wrapped.stage_rank_state(torch.load(path, weights_only=True)["commopt"])

    accelerator.register_save_state_pre_hook(save_rank_state)
    accelerator.register_load_state_pre_hook(load_rank_state)
    return module, prepared
