"""Each component of the optimizer on its own: the schedules, the step applier, the counter.

Built from a local communicator and a GradientReducer, with no MultiNodeOptimizer: what
each schedule sends when, what it hands ``step()`` to apply, and its state dict.
"""

import pytest
import torch

import commopt
from commopt.optim.apply_step import StepApplier
from commopt.optim.bucketed_params import BucketedParameters
from commopt.optim.reduction_counter import ReductionCounter
from commopt.optim.schedules.double_buffered import CompensatedSchedule, DoubleBufferedSchedule
from commopt.optim.schedules.protocol import ScheduleContext
from commopt.optim.schedules.synchronous import SynchronousOptions, SynchronousSchedule
from commopt.optim.step_progress import Stage
from commopt.reducer import GradientReducer, StepResult


@pytest.fixture(scope="module")
def comm():
    return commopt.create_communicator("local")


def params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]


def wire(cls, comm, ps, options=None, counter=None, inner=None):
    """A schedule of class ``cls`` over ``ps`` (its buckets, hooks and context)."""
    made = []
    owned = BucketedParameters(lambda i: made[0].grad_ready(i), lambda: made[0].backward_end())
    reducer = GradientReducer(
        comm, ps, ["a", "b"], num_buffers=cls.num_buffers, bucket_cap_mb=1e-5, grad_views=True
    )
    owned.install(reducer, ps)
    context = ScheduleContext(
        owned,
        ReductionCounter() if counter is None else counter,
        torch.optim.SGD(ps, lr=0.1) if inner is None else inner,
        zero_fill=True,
        ensure_layout=lambda: None,
        all_params=lambda: ps,
    )
    made.append(cls(context, options))
    return made[0], owned


def backward(ps, scale=1.0):
    (scale * (ps[0].sum() + (ps[1] ** 2).sum())).backward()


def expected_grads(ps):
    return [torch.ones(3), 2 * ps[1].detach()]


def test_synchronous_with_overlap_sends_during_backward(comm):
    ps = params()
    counter = ReductionCounter()
    sync, owned = wire(SynchronousSchedule, comm, ps, SynchronousOptions(overlap=True), counter)
    assert len(owned.reducer.buckets) == 2
    backward(ps)
    # Both buckets left during backward, and the hooks queued the end of backward, which
    # finished the reduction: backward() returned with the averages in .grad.
    assert sync.stage is Stage.AVERAGED and sync.in_flight is None
    assert sync.averages.issued == 2 and counter.next == 1
    result = sync.result(skip_synchronize=False)
    assert result.nonfinite is False and sync.stage is Stage.IDLE
    for p, g in zip(ps, expected_grads(ps)):
        assert torch.equal(p.grad, g)


def test_synchronous_without_overlap_sends_in_step_and_refuses_a_local_clip(comm):
    ps = params()
    sync, _ = wire(SynchronousSchedule, comm, ps, SynchronousOptions(overlap=False))
    backward(ps)
    sync.backward_end()
    assert sync.stage is Stage.LOCAL and sync.in_flight is None
    with pytest.raises(RuntimeError, match="skip_synchronize"):
        sync.result(skip_synchronize=True)
    ps[0].grad.mul_(0.5)  # a clip of the local gradients
    with pytest.raises(RuntimeError, match="before commopt averaged it"):
        sync.result(skip_synchronize=False)
    sync.synchronize()  # an explicit synchronize() accepts what .grad holds now
    assert sync.result(skip_synchronize=True).nonfinite is False
    assert sync.state_dict() == {"pending": None}


def test_double_buffered_applies_the_previous_steps_averages_and_resumes(comm):
    ps = params()
    db, _ = wire(DoubleBufferedSchedule, comm, ps)
    backward(ps)
    first = expected_grads(ps)
    assert db.result(skip_synchronize=False) is None  # sent; nothing to apply yet
    assert db.pending is not None
    for p in ps:
        p.grad = None
    backward(ps, scale=3.0)
    result = db.result(skip_synchronize=False)
    assert result is not None and not result.nonfinite
    for p, g in zip(ps, first):  # step 1 applies step 0's averages
        assert torch.equal(p.grad, g)
    state = db.state_dict()
    assert state["pending"] is not None
    # A fresh schedule on the same buckets resumes with the same pending reduction.
    again, _ = wire(DoubleBufferedSchedule, comm, ps)
    again.load_state_dict(state, rank=0)
    assert not again.flush().nonfinite
    for p, g in zip(ps, first):
        assert torch.equal(p.grad, 3 * g)
    assert again.flush() is None and again.pending is None


def test_compensated_moves_to_the_prediction_and_back(comm):
    ps = params()
    inner = torch.optim.SGD(ps, lr=0.1)
    db, _ = wire(CompensatedSchedule, comm, ps, inner=inner)
    true = [p.detach().clone() for p in ps]
    backward(ps)
    local = expected_grads(ps)
    result = db.result(skip_synchronize=False)
    db.after_step(result, max_norm=None)
    for p, w, g in zip(ps, true, local):  # predicted: one local SGD step ahead
        assert torch.allclose(p.detach(), w - 0.1 * g)
    with db.true_weights():
        assert all(torch.equal(p.detach(), w) for p, w in zip(ps, true))
    assert "predicted" in db.state_dict()
    db.flush()  # the model keeps the true weights from here on
    assert all(torch.equal(p.detach(), w) for p, w in zip(ps, true))


def test_step_applier_skips_nonfinite_steps_and_clips_one_global_norm():
    w = torch.nn.Parameter(torch.zeros(2))
    applier = StepApplier(torch.optim.SGD([w], lr=1.0), rank=1, clip_grad_norm=1.0)
    w.grad = torch.tensor([3.0, 4.0])
    applier.apply(StepResult(nonfinite=True, bad_buckets=[0], present=[True]), [w])
    assert (applier.applied_steps, applier.skipped_steps, applier.last_step_skipped) == (0, 1, True)
    assert torch.equal(w.detach(), torch.zeros(2))
    applier.apply(StepResult(nonfinite=False, bad_buckets=[], present=[True]), [w])
    assert float(applier.last_grad_norm) == 5.0 and applier.applied_steps == 1
    assert torch.allclose(w.detach(), torch.tensor([-0.6, -0.8]))
    applier.apply(None, [w])  # nothing to apply (double buffering's first step)
    assert applier.state_dict() == {"applied_steps": 1, "skipped_steps": 1}


def test_reduction_counter_gives_a_skipped_steps_number_back(comm):
    w = torch.nn.Parameter(torch.zeros(2))
    reducer = GradientReducer(comm, [w], ["w"])
    counter = ReductionCounter()
    calls = []
    handle = counter.on_start(lambda: calls.append(counter.next))
    w.grad = torch.tensor([float("nan"), 0.0])
    red = counter.start(reducer)
    red.issue_remaining()
    assert red.wait().nonfinite and counter.saved(reducer) == 0  # given back
    w.grad = torch.ones(2)
    assert counter.start(reducer).number == 0 and calls == [0, 1]
    handle.remove()
    counter.start(reducer)
    assert calls == [0, 1]


@pytest.mark.parametrize(
    "key, value, plan",
    [
        ("compression", "fp16", "compression=fp16, schedule=synchronous"),
        ("double_buffering", "stale", "compression=None, schedule=stale"),
    ],
)
def test_a_new_group_plan_on_a_one_plan_optimizer_makes_a_part_of_its_own(comm, key, value, plan):
    a, b = params()
    c = torch.nn.Parameter(torch.zeros(2))
    opt = commopt.create_multi_node_optimizer(torch.optim.SGD([a], lr=0.1), comm)
    opt.add_param_group({"params": [b], key: value})
    assert list(opt.plans) == ["compression=None, schedule=synchronous", plan]
    assert opt.plan_params(plan) == [b]
    with pytest.raises(TypeError, match="compression must be"):
        opt.add_param_group({"params": [c], "compression": True})
    assert len(opt.param_groups) == 2, "the refused group was not added"
