"""The step in progress: the stage of the current step's gradient reduction (synchronous schedule).

Without double buffering a step's gradients go through a few stages between backward and
``step()``; :class:`StepProgress` holds the stage and the reduction that belongs to it, so the
optimizer asks it instead of combining flags. Each event is one method; an event that cannot
happen in the present stage raises :class:`StageError` (a bug in the caller, never a
silent change of stage).

Events and stages (``collect`` and ``averaged`` are ``synchronize()``, ``take`` is ``step()``)::

    IDLE -wrote-> LOCAL -send-> SENDING -collect-> LOCAL -averaged-> AVERAGED -take-> IDLE
    IDLE, LOCAL or AVERAGED_PLUS_LOCAL -collect-> IDLE or LOCAL (no reduction in flight yet)
    AVERAGED -wrote-> AVERAGED_PLUS_LOCAL -drop-> LOCAL;   AVERAGED -drop-> IDLE

``drop()`` (the averages are not applied: ``zero_grad()`` after a skipped step) forgets
unapplied averages; ``reset()`` (``close()``, ``load_state_dict()``) forgets any reduction in
any stage. Gradients written since the last reduction keep the stage ``LOCAL``.

    >>> step = StepProgress()
    >>> step.wrote(); step.stage
    <Stage.LOCAL: 'local'>
    >>> step.take()
    Traceback (most recent call last):
      ...
    commopt.optim.step_progress.StageError: internal: take() (step() applies the averages) in stage 'local'; allowed in: averaged
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from commopt.reducer import StepReduction

__all__ = ["Stage", "StageError", "StepProgress"]


class Stage(enum.Enum):
    """Where the current step's gradients are, between backward and ``step()``."""

    IDLE = "idle"  # no gradient since the last reduction was applied or dropped
    LOCAL = "local"  # backward wrote gradients; none of them is being reduced
    SENDING = "sending"  # backward hooks sent some of this step's buckets, not all yet
    AVERAGED = "averaged"  # param.grad holds the averages, not applied yet
    AVERAGED_PLUS_LOCAL = "averaged_plus_local"  # averaged, then a backward wrote again


class StageError(RuntimeError):
    """An event the present stage does not allow (a bug in the caller)."""


_AFTER_WRITE = {Stage.IDLE: Stage.LOCAL, Stage.AVERAGED: Stage.AVERAGED_PLUS_LOCAL}
_AFTER_DROP = {Stage.AVERAGED: Stage.IDLE, Stage.AVERAGED_PLUS_LOCAL: Stage.LOCAL}


class StepProgress:
    """The stage of the current step's reduction and the reduction of that stage."""

    def __init__(self) -> None:
        self._stage = Stage.IDLE
        self._reduction: StepReduction | None = None  # SENDING's or the AVERAGED* stages'

    def __repr__(self) -> str:
        return f"StepProgress({self._stage.value})"

    @property
    def stage(self) -> Stage:
        return self._stage

    @property
    def in_flight(self) -> StepReduction | None:
        """The reduction the backward hooks are sending (stage SENDING), else None."""
        return self._reduction if self._stage is Stage.SENDING else None

    @property
    def averages(self) -> StepReduction | None:
        """The finished reduction whose averages are in ``param.grad`` and not applied, else None."""
        averaged = self._stage in (Stage.AVERAGED, Stage.AVERAGED_PLUS_LOCAL)
        return self._reduction if averaged else None

    @property
    def started(self) -> bool:
        """Whether this step's reduction started (sending, or averaged and not applied)."""
        return self._reduction is not None

    @property
    def has_local(self) -> bool:
        """Whether ``param.grad`` holds gradients not yet averaged (a reduction would send them)."""
        return self._stage in (Stage.LOCAL, Stage.SENDING, Stage.AVERAGED_PLUS_LOCAL)

    # -- events ---------------------------------------------------------------------------
    def wrote(self) -> None:
        """Backward wrote a gradient: IDLE -> LOCAL, AVERAGED -> AVERAGED_PLUS_LOCAL."""
        self._stage = _AFTER_WRITE.get(self._stage, self._stage)

    def drop(self) -> None:
        """The averages are not applied: AVERAGED -> IDLE, AVERAGED_PLUS_LOCAL -> LOCAL."""
        if self._stage in _AFTER_DROP:
            self._stage, self._reduction = _AFTER_DROP[self._stage], None

    def send(self, reduction: StepReduction) -> None:
        """LOCAL -> SENDING: the backward hooks started this step's ``reduction``."""
        self._expect("send() (the hooks start a reduction)", Stage.LOCAL)
        self._stage, self._reduction = Stage.SENDING, reduction

    def collect(self) -> StepReduction | None:
        """``synchronize()`` takes over: the reduction in flight (None: none), stage LOCAL or IDLE.

        Unapplied averages are dropped. Until :meth:`averaged`, the gradients count as local:
        a reduction that fails leaves them to be sent again.
        """
        self._expect(
            "collect() (synchronize() finishes the reduction)",
            Stage.IDLE,
            Stage.LOCAL,
            Stage.SENDING,
            Stage.AVERAGED_PLUS_LOCAL,
        )
        reduction = self.in_flight
        self._stage = Stage.IDLE if self._stage is Stage.IDLE else Stage.LOCAL
        self._reduction = None
        return reduction

    def averaged(self, reduction: StepReduction) -> None:
        """IDLE or LOCAL -> AVERAGED: ``reduction``'s averages are unpacked into ``param.grad``."""
        self._expect("averaged() (the averages landed)", Stage.IDLE, Stage.LOCAL)
        self._stage, self._reduction = Stage.AVERAGED, reduction

    def take(self) -> StepReduction:
        """AVERAGED -> IDLE: ``step()`` applies the averaged reduction, returned."""
        self._expect("take() (step() applies the averages)", Stage.AVERAGED)
        reduction = self._reduction
        if reduction is None:  # (the AVERAGED stage always holds its reduction)
            raise StageError("internal: stage 'averaged' without its reduction")
        self._stage, self._reduction = Stage.IDLE, None
        return reduction

    def reset(self) -> None:
        """Forget any reduction (``close()``, ``load_state_dict()``); written gradients stay LOCAL."""
        self._stage = Stage.LOCAL if self.has_local else Stage.IDLE
        self._reduction = None

    def _expect(self, event: str, *allowed: Stage) -> None:
        if self._stage not in allowed:
            raise StageError(
                f"internal: {event} in stage {self._stage.value!r}; allowed in: "
                + ", ".join(s.value for s in allowed)
            )
