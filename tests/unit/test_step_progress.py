"""The optimizer's step in progress (commopt.optim.step_progress): stages, events, invalid events."""

from __future__ import annotations

import pytest

from commopt.optim.step_progress import Stage, StageError, StepProgress

RED = object()  # a stand-in reduction: StepProgress only holds it


def in_stage(stage: Stage) -> StepProgress:
    """A StepProgress brought to ``stage`` by the events the optimizer sends."""
    step = StepProgress()
    if stage is Stage.IDLE:
        return step
    step.wrote()
    if stage is Stage.LOCAL:
        return step
    step.send(RED)
    if stage is Stage.SENDING:
        return step
    assert step.collect() is RED
    step.averaged(RED)
    if stage is Stage.AVERAGED:
        return step
    step.wrote()
    assert stage is Stage.AVERAGED_PLUS_LOCAL
    return step


def test_a_step_with_overlap_goes_through_every_stage_in_order():
    step = StepProgress()
    seen = [step.stage]
    step.wrote()
    seen.append(step.stage)
    step.send(RED)
    seen.append(step.stage)
    assert step.in_flight is RED and step.averages is None and step.started
    step.wrote()  # later gradients of the same backward
    assert step.collect() is RED
    seen.append(step.stage)
    step.averaged(RED)
    seen.append(step.stage)
    assert step.averages is RED and step.in_flight is None and not step.has_local
    assert step.take() is RED
    seen.append(step.stage)
    assert seen == [Stage.IDLE, Stage.LOCAL, Stage.SENDING, Stage.LOCAL, Stage.AVERAGED, Stage.IDLE]
    assert not step.started and not step.has_local


def test_synchronize_without_hooks_starts_from_idle_or_local():
    for start in (Stage.IDLE, Stage.LOCAL):
        step = in_stage(start)
        assert step.collect() is None and step.stage is start
        step.averaged(RED)
        assert step.stage is Stage.AVERAGED


def test_a_backward_after_the_averages_then_drop_leaves_local_gradients():
    step = in_stage(Stage.AVERAGED_PLUS_LOCAL)
    assert step.averages is RED and step.has_local and step.started
    step.drop()
    assert step.stage is Stage.LOCAL and step.averages is None and not step.started
    step.send(RED)  # the hooks may start a new reduction from here
    assert step.stage is Stage.SENDING


def test_collect_drops_averages_written_over():
    step = in_stage(Stage.AVERAGED_PLUS_LOCAL)
    assert step.collect() is None
    assert step.stage is Stage.LOCAL and step.averages is None


@pytest.mark.parametrize(
    ("start", "after"),
    [
        (Stage.IDLE, Stage.IDLE),
        (Stage.LOCAL, Stage.LOCAL),
        (Stage.SENDING, Stage.SENDING),  # drop() never touches a reduction in flight
        (Stage.AVERAGED, Stage.IDLE),
        (Stage.AVERAGED_PLUS_LOCAL, Stage.LOCAL),
    ],
)
def test_drop_forgets_only_unapplied_averages(start, after):
    step = in_stage(start)
    step.drop()
    assert step.stage is after


@pytest.mark.parametrize(
    ("start", "after"),
    [
        (Stage.IDLE, Stage.IDLE),
        (Stage.LOCAL, Stage.LOCAL),
        (Stage.SENDING, Stage.LOCAL),
        (Stage.AVERAGED, Stage.IDLE),
        (Stage.AVERAGED_PLUS_LOCAL, Stage.LOCAL),
    ],
)
def test_reset_forgets_every_reduction_and_keeps_local_gradients_marked(start, after):
    step = in_stage(start)
    step.reset()
    assert step.stage is after and not step.started


INVALID = [
    ("send", (RED,), [Stage.IDLE, Stage.SENDING, Stage.AVERAGED, Stage.AVERAGED_PLUS_LOCAL]),
    ("collect", (), [Stage.AVERAGED]),
    ("averaged", (RED,), [Stage.SENDING, Stage.AVERAGED, Stage.AVERAGED_PLUS_LOCAL]),
    ("take", (), [Stage.IDLE, Stage.LOCAL, Stage.SENDING, Stage.AVERAGED_PLUS_LOCAL]),
]


@pytest.mark.parametrize(
    ("event", "args", "stage"),
    [(event, args, stage) for event, args, stages in INVALID for stage in stages],
    ids=lambda v: v.value if isinstance(v, Stage) else (v if isinstance(v, str) else ""),
)
def test_an_invalid_event_raises_naming_it_and_changes_nothing(event, args, stage):
    step = in_stage(stage)
    before = (step.stage, step.in_flight, step.averages)
    with pytest.raises(StageError, match=rf"{event}\(\).* in stage '{stage.value}'"):
        getattr(step, event)(*args)
    assert (step.stage, step.in_flight, step.averages) == before


def test_every_stage_allows_wrote_drop_and_reset():
    for stage in Stage:
        for event in ("wrote", "drop", "reset"):
            getattr(in_stage(stage), event)()  # never raises
