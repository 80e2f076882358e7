"""A schedule added as one class plus one registry line, run by the optimizer without edits.

``AccumulateSchedule`` below is a whole schedule written against the protocol alone
(``commopt.optim.schedules.protocol``): it keeps each step's local gradients and reduces their
mean every ``accumulate_every`` steps (the steps between apply nothing). It declares an option
(``accumulate_every``), its checkpoint keys, and registers under a name; the optimizer then
builds it from ``create_multi_node_optimizer(..., schedule="accumulate")``, passes it the
option, applies its results, saves and restores its state, and mixes it with the synchronous
schedule in per-group plans. The oracle is plain arithmetic: the mean of each pair of steps'
gradients applied once, as an SGD without commopt does it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import commopt
from commopt.optim import schedules
from commopt.optim.schedules.protocol import ScheduleBase, ScheduleContext


@dataclass(frozen=True)
class AccumulateOptions:
    accumulate_every: int = 2


class AccumulateSchedule(ScheduleBase):
    """Reduce the mean of the last ``accumulate_every`` steps' gradients, once per cycle."""

    name = "accumulate"
    options = AccumulateOptions
    checkpoint_keys = ("accumulated", "position")
    supports_closures = False

    def __init__(self, context: ScheduleContext, options: AccumulateOptions | None = None):
        super().__init__(context, options)
        self.every = int(self.settings.accumulate_every)
        self.position = 0  # steps accumulated in this cycle
        self.accumulated: list[torch.Tensor] | None = None

    def synchronize(self, explicit: bool = True) -> None:
        """Nothing to finish early: the cycle's reduction happens in ``step()``."""

    def result(self, *, skip_synchronize: bool, scale: Any = None, found_inf: Any = None):
        params = self.bucketed.params
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        if self.accumulated is None:
            self.accumulated = grads
        else:
            torch._foreach_add_(self.accumulated, grads)
        self.position += 1
        if self.position < self.every:
            return None  # nothing to apply until the cycle ends
        for p, g in zip(params, self.accumulated):
            p.grad = g / self.every
        self.accumulated, self.position = None, 0
        reduction = self.counter.start(self.bucketed.reducer)
        reduction.issue_remaining()
        reduction.write_averages(self.zero_fill)
        return reduction.result()

    def state_dict(self) -> dict[str, Any]:
        return {"accumulated": self.accumulated, "position": self.position}

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        self.accumulated = state.get("accumulated")
        self.position = int(state.get("position", 0))


@pytest.fixture
def accumulate():
    schedules.register_schedule("accumulate", AccumulateSchedule)  # the one registry line
    yield
    schedules.unregister_schedule("accumulate")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _grads(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _train(model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad()
        _grads(model, step)
        opt.step()


def test_a_registered_schedule_runs_in_the_optimizer_and_matches_its_oracle(accumulate):
    model = _model()
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        commopt.create_communicator("local"),
        model=model,
        schedule="accumulate",
        accumulate_every=3,
    )
    assert type(opt.schedule) is AccumulateSchedule and opt.schedule.every == 3
    assert list(opt.plans) == ["compression=None, schedule=accumulate"]
    _train(model, opt, range(6))
    assert opt.applied_steps == 2  # one inner step per cycle of three

    oracle = _model()
    sgd = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for cycle in range(2):
        total = [torch.zeros_like(p) for p in oracle.parameters()]
        for step in range(3 * cycle, 3 * cycle + 3):
            sgd.zero_grad()
            _grads(oracle, step)
            for t, p in zip(total, oracle.parameters()):
                t += p.grad
        for t, p in zip(total, oracle.parameters()):
            p.grad = t / 3
        sgd.step()
    for a, b in zip(model.parameters(), oracle.parameters()):
        assert torch.allclose(a, b, atol=1e-7), (a - b).abs().max()


def test_its_state_is_checkpointed_mid_cycle_and_resumes_exactly(accumulate):
    def build():
        model = _model()
        opt = commopt.create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            commopt.create_communicator("local"),
            model=model,
            schedule="accumulate",
        )
        return model, opt

    model, opt = build()
    _train(model, opt, range(3))  # one cycle and a half
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    (part,) = saved["opt"]["commopt"]["plans"].values()
    assert part["position"] == 1 and part["accumulated"] is not None
    _train(model, opt, range(3, 7))
    model2, opt2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _train(model2, opt2, range(3, 7))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_it_mixes_with_the_synchronous_schedule_in_per_group_plans(accumulate):
    model = _model()
    inner = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "schedule": "accumulate"},
            {"params": model[2].parameters()},
        ],
        lr=0.1,
    )
    opt = commopt.create_multi_node_optimizer(
        inner, commopt.create_communicator("local"), model=model
    )
    assert [type(s).__name__ for s in opt.plans.values()] == [
        "AccumulateSchedule",
        "SynchronousSchedule",
    ]
    first = model[0].weight.detach().clone()
    last = model[2].weight.detach().clone()
    _train(model, opt, range(1))
    # One step: the synchronous part applied its average; the accumulating part nothing yet.
    assert torch.equal(model[0].weight, first) and not torch.equal(model[2].weight, last)
    _train(model, opt, range(1, 2))
    assert not torch.equal(model[0].weight, first)


def test_an_option_no_schedule_declares_is_refused_naming_the_declared_ones():
    with pytest.raises(TypeError, match=r"accumulate_every.*overlap"):
        commopt.create_multi_node_optimizer(
            torch.optim.SGD(_model().parameters(), lr=0.1),
            commopt.create_communicator("local"),
            accumulate_every=2,
        )
    with pytest.raises(ValueError, match="unknown schedule 'accumulate'"):
        commopt.create_multi_node_optimizer(
            torch.optim.SGD(_model().parameters(), lr=0.1),
            commopt.create_communicator("local"),
            schedule="accumulate",
        )


def test_every_registered_schedule_declares_what_the_protocol_asks():
    from dataclasses import MISSING, fields, is_dataclass

    for name in schedules.names():
        cls = schedules.schedule_class(name)
        assert cls.name == name
        assert is_dataclass(cls.options) and cls.options.__dataclass_params__.frozen
        assert all(f.default is not MISSING for f in fields(cls.options)), name  # defaults
        assert cls.num_buffers in (1, 2)
        assert set(cls.own_keys) <= set(cls.checkpoint_keys), name
        for event in ("grad_ready", "backward_end", "synchronize", "result", "after_step"):
            assert callable(getattr(cls, event)), (name, event)
