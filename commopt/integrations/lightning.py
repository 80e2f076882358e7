"""PyTorch Lightning: a strategy that trains with commopt's optimizer instead of DDP.

    import lightning as L
    from commopt.integrations.lightning import CommoptStrategy

    trainer = L.Trainer(
        accelerator="cpu",  # or "gpu"
        devices=2,
        strategy=CommoptStrategy(compression="qsgd4+ef", double_buffering=True),
    )
    trainer.fit(model, loader)

:class:`CommoptStrategy` starts the processes and the process group as Lightning's
``DDPStrategy`` does, leaves the model unwrapped and wraps each optimizer returned by
``configure_optimizers`` with :func:`commopt.create_multi_node_optimizer`; every keyword of
that function except ``model`` (which is the LightningModule) is an argument of the
strategy: codecs, double buffering and compensation, overlap, buckets, the policy, the
collective algorithm, on CPU (gloo) and GPU (nccl). What Lightning does around the step keeps
its meaning:

- ``optimizer.step(closure)`` runs the closure (training step, backward, the hooks before the
  step) and then the step; LBFGS gets the closure itself (commopt averages each evaluation).
- gradient accumulation (``accumulate_grad_batches``) runs the micro-batches before the last
  inside commopt's ``no_sync()``: one reduction per optimizer step.
- ``gradient_clip_val`` with the norm algorithm becomes commopt's ``clip_grad_norm=``: the
  averaged gradients are clipped to that global norm, identically on every rank, in every
  mode (under local steps, each rank's own gradients: see below). The value algorithm is
  kept where the gradients are averaged before Lightning clips them (``overlap=True``
  without double buffering) and under local steps (where each rank applies its own
  gradients), and refused elsewhere, with the fix.
- checkpoints: rank 0 writes Lightning's file as usual, and every rank writes its own part
  of commopt's state (error-feedback residuals differ per rank) next to it, as
  ``<checkpoint>.commopt-rank<R>.pt``; ``ckpt_path=`` restores each rank's own part.
  With double buffering the last gradients are applied when training ends (``flush()``).
- compensated double buffering (``double_buffering=True``): between steps the model holds
  each rank's predicted weights; validation runs, and Lightning's checkpoint file is
  written, at the true weights (``opt.true_weights()``), and each rank's own part of the
  checkpoint puts its predicted weights back on resume.
- local steps (``CommoptStrategy(schedule="local_steps", sync_every=H, fragments=P,
  overlap_steps=tau, outer_lr=..., compression=...)``, DiLoCo and Streaming DiLoCo): each
  rank's inner optimizer steps on its own gradients and the weights differ between ranks
  until a synchronisation. Validation runs at the anchor (the weights every rank agreed on
  at the last synchronisation, identical on every rank) and Lightning's checkpoint file holds
  the anchor, so it serves inference; each rank's own part holds its local weights, inner
  optimizer state, error-feedback residuals of the outer gradients, the outer optimizer's
  state and the position in the cycle (a reduction in flight saved completed), and
  ``ckpt_path=`` resumes exactly, also from a step inside a cycle. Accumulation and
  clipping keep their meaning per rank: ``accumulate_grad_batches`` makes one inner step of
  several micro-batches, and ``gradient_clip_val`` (norm or value) clips each rank's own
  gradients before its inner step. When training ends the strategy calls
  ``opt.final_sync()``: the fragments with inner steps since their last synchronisation
  synchronise (their outer step taken), so the trained model is the anchor, the same on
  every rank (no step is lost when training stops inside a cycle; with one fragment and no
  overlap, a run whose steps are a multiple of ``sync_every`` ends synchronised and the call
  changes nothing). Lightning calls the callbacks' ``on_train_end`` before the strategy's: a
  callback that saves the model there sees each rank's local weights (save inside
  ``opt.true_weights()``, or after ``fit``).

The DDP communication-hook path (:mod:`commopt.integrations.ddp`) is
:class:`CommoptHookStrategy`: Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a
hook only on CUDA devices and drops it silently elsewhere (commopt's hook state then raises
at the first forward, naming this strategy); this one registers it on every device.

Uses the ``lightning`` package (``lightning.pytorch``), imported when this module is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from commopt.comm import Communicator, create_communicator
from commopt.integrations.ddp import CommoptHookState, commopt_hook
from commopt.optim import MultiNodeOptimizer
from commopt.optim.schedules import schedule_class
from commopt.optim.settings import Settings

__all__ = ["CommoptHookStrategy", "CommoptStrategy", "rank_state_path"]

# Made by the module's __getattr__ on first use (they subclass Lightning's DDPStrategy).
CommoptStrategy: type
CommoptHookStrategy: type

#: Keywords of create_multi_node_optimizer the strategy sets itself.
_OWN = ("model",)


def rank_state_path(checkpoint_path: str, rank: int) -> str:
    """Where rank ``rank`` keeps its part of commopt's state for ``checkpoint_path``."""
    return f"{checkpoint_path}.commopt-rank{rank}.pt"


class _LightningStep(MultiNodeOptimizer):
    """commopt's optimizer with the ``step(closure)`` Lightning uses for every optimizer.

    Lightning passes a closure to every ``step()``: training step, backward, then the hooks
    that run before the step. For an optimizer that evaluates its closure once (SGD, Adam...)
    that is "run the closure, then step", which is what this does, in every commopt mode
    (double buffering included, which cannot re-evaluate a closure inside the step). LBFGS,
    which evaluates it several times, gets the closure (commopt averages every evaluation).
    """

    def step(self, closure: Callable[[], Any] | None = None):
        if closure is None or isinstance(self.inner, torch.optim.LBFGS):
            return super().step(closure)
        with torch.enable_grad():
            loss = closure()
        super().step()
        return loss


def __getattr__(name: str) -> Any:
    # The strategies subclass Lightning's DDPStrategy: they are made when first asked for,
    # so that importing this module (pytest's doctest collection does) needs no Lightning.
    if name in ("CommoptStrategy", "CommoptHookStrategy"):
        return _strategies()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _strategies() -> dict[str, type]:
    try:
        from lightning.pytorch.strategies import DDPStrategy
    except ImportError as exc:  # an optional integration: say how to get it
        raise ImportError(
            "commopt.integrations.lightning needs PyTorch Lightning: "
            "pip install 'lightning==2.6.6' (or pip install 'commopt[lightning]')"
        ) from exc

    class CommoptStrategy(DDPStrategy):
        """Lightning strategy: processes as DDPStrategy, gradients averaged by commopt's optimizer.

        ``compression``, ``double_buffering`` and every other keyword (``overlap``,
        ``bucket_cap_mb``, ``policy``, ``algorithm``, ``allreduce_grad_dtype``, ``seed``,
        ``clip_grad_norm``, ``zero_fill``, ...) go to :func:`commopt.create_multi_node_optimizer`.
        ``communicator`` (default ``"torch"``: the process group Lightning creates, gloo on CPU
        and nccl on GPU) and ``communicator_options`` go to :func:`commopt.create_communicator`.
        ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
        ``precision_plugin``, ``process_group_backend``, ``timeout`` and ``start_method`` are
        DDPStrategy's.
        """

        def __init__(
            self,
            compression: Any = None,
            double_buffering: bool | str = False,
            *,
            communicator: str = "torch",
            communicator_options: dict[str, Any] | None = None,
            accelerator=None,
            parallel_devices=None,
            cluster_environment=None,
            checkpoint_io=None,
            precision_plugin=None,
            process_group_backend: str | None = None,
            timeout=None,
            start_method: str = "popen",
            **optimizer_options: Any,
        ):
            own = [k for k in _OWN if k in optimizer_options]
            if own:
                raise TypeError(
                    f"CommoptStrategy sets {own} itself (the LightningModule); leave it out"
                )
            ddp_kwargs: dict[str, Any] = {}
            if timeout is not None:
                ddp_kwargs["timeout"] = timeout
            super().__init__(
                accelerator=accelerator,
                parallel_devices=parallel_devices,
                cluster_environment=cluster_environment,
                checkpoint_io=checkpoint_io,
                precision_plugin=precision_plugin,
                process_group_backend=process_group_backend,
                start_method=start_method,  # type: ignore[arg-type]
                **ddp_kwargs,
            )
            self.optimizer_options: dict[str, Any] = dict(
                compression=compression, double_buffering=double_buffering, **optimizer_options
            )
            self.communicator = communicator
            self.communicator_options = dict(communicator_options or {})
            self._comm: Communicator | None = None
            self._moved_clip: tuple[Any, Any] | None = None  # (trainer, its gradient_clip_val)
            self._true_weights: contextlib.ExitStack | None = None  # inside validation

        # -- the model stays unwrapped: commopt's optimizer does the communication -------------
        def configure_ddp(self) -> None:
            """No DistributedDataParallel: the optimizer averages the gradients (and broadcasts
            rank 0's parameters and buffers when it is created)."""

        # -- optimizers -------------------------------------------------------------------------
        def setup_optimizers(self, trainer) -> None:
            super().setup_optimizers(trainer)
            options = self._options_for(trainer)
            self.optimizers = [self._wrap(opt, options) for opt in self.optimizers]

        def _wrap(self, optimizer, options: dict[str, Any]):
            if isinstance(optimizer, MultiNodeOptimizer):
                raise TypeError(
                    "configure_optimizers returned an optimizer already wrapped by "
                    "create_multi_node_optimizer: with CommoptStrategy return the plain torch "
                    "optimizer; the strategy wraps it with the strategy's options"
                )
            if not any(g["params"] for g in optimizer.param_groups):
                return optimizer  # Lightning's stand-in when configure_optimizers returns None
            return _LightningStep(
                optimizer, self._communicator(), model=self.lightning_module, **options
            )

        def _communicator(self) -> Communicator:
            if self._comm is None:
                self._comm = create_communicator(self.communicator, **self.communicator_options)
            return self._comm

        def _options_for(self, trainer) -> dict[str, Any]:
            """The optimizer's options, with the Trainer's gradient clipping mapped onto them."""
            options = dict(self.optimizer_options)
            clip_val = trainer.gradient_clip_val
            if not clip_val:
                return options
            # (Lightning's GradClipAlgorithmType: a str enum; None means "norm")
            algorithm = getattr(trainer.gradient_clip_algorithm, "value", None) or "norm"
            # Lightning clips between backward and step. What it clips there is what the step
            # applies when the step applies each rank's own gradients (a schedule that does not
            # reduce every step: local steps' inner steps), or this step's average reduced
            # during the backward (overlap, and a schedule whose reduction does not overlap the
            # next step).
            schedule = schedule_class(Settings.of(**options).default_schedule)
            averaged_before_clip = not schedule.reduces_every_step or bool(
                options.get("overlap", True) and not schedule.overlaps_step
            )
            if algorithm == "norm":
                if options.get("clip_grad_norm") not in (None, clip_val):
                    raise ValueError(
                        f"Trainer(gradient_clip_val={clip_val}) and CommoptStrategy("
                        f"clip_grad_norm={options['clip_grad_norm']}) disagree: set one of them"
                    )
                # commopt clips the averaged gradients (the same decision on every rank, in every
                # mode); Lightning's own clipping, between backward and step, would clip each
                # rank's local gradients where they are not averaged yet.
                options["clip_grad_norm"] = float(clip_val)
                self._moved_clip = (trainer, clip_val)
                trainer.gradient_clip_val = None
            elif not averaged_before_clip:
                raise ValueError(
                    f"gradient_clip_algorithm={algorithm!r} clips each rank's own gradients before "
                    "commopt averages them with double_buffering or overlap=False (the ranks would "
                    "apply different clips): use gradient_clip_algorithm='norm' (commopt clips the "
                    "averaged gradients), or CommoptStrategy(overlap=True, double_buffering=False), "
                    "where the gradients are averaged when backward returns"
                )
            return options

        def _commopt_optimizers(self) -> list[MultiNodeOptimizer]:
            return [o for o in self.optimizers if isinstance(o, MultiNodeOptimizer)]

        @contextlib.contextmanager
        def block_backward_sync(self) -> Iterator[None]:
            """Lightning's gradient accumulation: the backward accumulates locally."""
            with contextlib.ExitStack() as stack:
                for opt in self._commopt_optimizers():
                    stack.enter_context(opt.no_sync())
                yield

        # -- compensated double buffering: the true weights where the model is read -------------
        def on_validation_start(self) -> None:
            super().on_validation_start()
            self._true_weights = contextlib.ExitStack()
            for opt in self._commopt_optimizers():
                self._true_weights.enter_context(opt.true_weights())

        def on_validation_end(self) -> None:
            stack, self._true_weights = self._true_weights, None
            if stack is not None:
                stack.close()
            super().on_validation_end()

        def lightning_module_state_dict(self) -> dict[str, Any]:
            """The model's state at its true weights: the agreed weights (each rank's predicted
            or local weights are in its own part of the checkpoint)."""
            predicting = [o for o in self._commopt_optimizers() if o.holds_local_weights]
            if not predicting:
                return super().lightning_module_state_dict()
            with contextlib.ExitStack() as stack:
                for opt in predicting:
                    stack.enter_context(opt.true_weights())
                return {k: v.clone() for k, v in super().lightning_module_state_dict().items()}

        def on_train_end(self) -> None:
            """With double buffering the last step's gradients are pending: apply them; under
            local steps the fragments with steps since their last synchronisation synchronise,
            so the trained model is the agreed one on every rank."""
            super().on_train_end()
            for opt in self._commopt_optimizers():
                opt.final_sync()

        def teardown(self) -> None:
            for opt in self._commopt_optimizers():
                opt.close()  # waits for reductions in flight, detaches the hooks
            if self._moved_clip is not None:
                trainer, clip_val = self._moved_clip
                trainer.gradient_clip_val = clip_val
                self._moved_clip = None
            super().teardown()

        # -- checkpoints: each rank's own part of commopt's state -------------------------------
        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            parts = [s.get("commopt") for s in checkpoint.get("optimizer_states", [])]
            if any(p is not None for p in parts):
                path = rank_state_path(str(filepath), self.global_rank)
                self.checkpoint_io.save_checkpoint({"optimizers": parts}, path)

        def load_checkpoint(self, checkpoint_path, weights_only=None):
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            states = checkpoint.get("optimizer_states", [])
            saved = [s.get("commopt") for s in states]
            if not any(p is not None for p in saved):
                return checkpoint
            path = rank_state_path(str(checkpoint_path), self.global_rank)
            try:
                own = self.checkpoint_io.load_checkpoint(path, weights_only=True)["optimizers"]
            except FileNotFoundError:
                if all(p is None or p.get("rank") == self.global_rank for p in saved):
                    return checkpoint  # rank 0 (or one rank): the main file holds its own part
                raise FileNotFoundError(
                    f"rank {self.global_rank}: {path} is missing; it holds this rank's part of "
                    f"commopt's state (error-feedback residuals) saved with {checkpoint_path}. "
                    "Copy the checkpoint's .commopt-rank*.pt files with it, or start the residuals "
                    "afresh: commopt.optim.drop_codec_state() on each optimizer state of the "
                    "checkpoint before resuming"
                ) from None
            if len(own) != len(states):
                raise ValueError(
                    f"rank {self.global_rank}: {path} holds {len(own)} optimizers' state, the "
                    f"checkpoint {len(states)}: they were not saved together"
                )
            checkpoint["optimizer_states"] = [
                {**s, "commopt": part} if part is not None else s for s, part in zip(states, own)
            ]
            return checkpoint

        def remove_checkpoint(self, filepath) -> None:
            super().remove_checkpoint(filepath)
            self.checkpoint_io.remove_checkpoint(rank_state_path(str(filepath), self.global_rank))

    class CommoptHookStrategy(DDPStrategy):
        """DDPStrategy with commopt's DDP communication hook registered on every device.

        ``hook_state`` is a :class:`~commopt.integrations.ddp.CommoptHookState`; the other
        arguments are DDPStrategy's (its own ``ddp_comm_hook``/``ddp_comm_state`` are refused: this
        strategy registers commopt's). Checkpoints carry the hook's state (the error-feedback
        residuals of each rank) as ``<checkpoint>.commopt-rank<R>.pt`` next to Lightning's file.
        For double buffering or compensation use :class:`CommoptStrategy`.
        """

        def __init__(self, hook_state: CommoptHookState, **kwargs: Any):
            if not isinstance(hook_state, CommoptHookState):
                raise TypeError(
                    f"hook_state must be a commopt.integrations.ddp.CommoptHookState, got "
                    f"{type(hook_state).__name__}"
                )
            taken = [
                k for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper") if k in kwargs
            ]
            if taken:
                raise TypeError(
                    f"CommoptHookStrategy registers commopt's hook itself: drop {taken}"
                )
            super().__init__(**kwargs)
            self.hook_state = hook_state

        def configure_ddp(self) -> None:
            super().configure_ddp()  # wraps the model; DDPStrategy registers no hook of ours
            ddp = self.model
            if not isinstance(ddp, DistributedDataParallel):
                raise RuntimeError(f"internal: DDPStrategy left a {type(ddp).__name__}, not DDP")
            ddp.register_comm_hook(self.hook_state, commopt_hook)

        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            if (
                "optimizer_states" in checkpoint
            ):  # (a weights-only checkpoint has no training state)
                path = rank_state_path(str(filepath), self.global_rank)
                self.checkpoint_io.save_checkpoint({"hook": self.hook_state.state_dict()}, path)

        def load_checkpoint(self, checkpoint_path, weights_only=None):
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            if "optimizer_states" in checkpoint:
                path = rank_state_path(str(checkpoint_path), self.global_rank)
                try:
                    part = self.checkpoint_io.load_checkpoint(path, weights_only=True)
                except FileNotFoundError:
                    raise FileNotFoundError(
                        f"rank {self.global_rank}: {path} is missing; it holds this rank's "
                        f"commopt hook state (error-feedback residuals) saved with "
                        f"{checkpoint_path}: copy the checkpoint's .commopt-rank*.pt files with it"
                    ) from None
                self.hook_state.load_state_dict(part["hook"])
            return checkpoint

        def remove_checkpoint(self, filepath) -> None:
            super().remove_checkpoint(filepath)
            self.checkpoint_io.remove_checkpoint(rank_state_path(str(filepath), self.global_rank))

    made: dict[str, type] = {}
    for cls in (CommoptStrategy, CommoptHookStrategy):
        cls.__qualname__ = cls.__name__  # pickled (spawn launcher) as this module's attribute
        made[cls.__name__] = cls
    return made
