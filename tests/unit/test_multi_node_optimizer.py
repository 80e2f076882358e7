"""create_multi_node_optimizer in one process (the "local" world of one).

What needs real ranks (averaging, consistent skips, mismatched models) is in
tests/distributed/; here: the torch.optim.Optimizer surface, buckets, hooks, double
buffering's exact stale-by-one rule, state dicts and the errors for bad input.
"""

import copy
import logging
import pickle

import pytest
import torch

import commopt
from commopt.codecs import CompressionPolicy
from commopt.optim import MultiNodeOptimizer, create_multi_node_optimizer


@pytest.fixture(scope="module")
def comm():
    return commopt.create_communicator("local")


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(5, 8, generator=g), torch.randn(5, 3, generator=g)


def loss(model, step):
    x, y = data(step)
    return torch.nn.functional.mse_loss(model(x), y)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


# -- the wrapper behaves as the optimizer it wraps -----------------------------------------------
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize(
    "factory",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
    ],
)
def test_world_of_one_equals_the_plain_optimizer_exactly(comm, factory, overlap):
    model, ref = mlp(), mlp()
    opt = create_multi_node_optimizer(
        factory(model.parameters()), comm, overlap=overlap, bucket_cap_mb=0.001
    )
    ref_opt = factory(ref.parameters())
    for step in range(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss(m, step).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert opt.applied_steps == 4 and opt.skipped_steps == 0


def test_optimizer_surface_lr_scheduler_closure_and_state(comm):
    model = mlp()
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=1.0), comm)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.inner.param_groups and opt.state is opt.inner.state
    assert opt.defaults["lr"] == 1.0
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def closure():
        opt.zero_grad()
        out = loss(model, 0)
        out.backward()
        return out

    value = opt.step(closure)
    assert isinstance(value, torch.Tensor)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    loss(model, 1).backward()
    opt.step()
    assert calls == ["pre", "post"]
    assert "MultiNodeOptimizer(SGD" in repr(opt)


def test_grad_scaler_works(comm):
    model, ref = mlp(), mlp()
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(loss(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        ref_opt.zero_grad()
        loss(ref, step).backward()
        ref_opt.step()
    assert all(
        torch.allclose(a, b, rtol=1e-6, atol=0)
        for a, b in zip(model.parameters(), ref.parameters())
    )


# -- buckets -------------------------------------------------------------------------------------
def test_buckets_are_homogeneous_capped_and_aligned(comm):
    model = torch.nn.Sequential(
        torch.nn.Linear(40, 50), torch.nn.Linear(50, 30), torch.nn.Linear(30, 2)
    )
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        comm,
        compression="qsgd4",
        model=model,
        bucket_cap_mb=0.01,
        policy=CompressionPolicy(min_compress_numel=100),
    )
    buckets = opt.buckets
    assert [b.index for b in buckets] == list(range(len(buckets)))
    seen = sorted(s.param for b in buckets for s in b.slots)
    assert seen == list(range(6))
    for b in buckets:
        names = [opt.schedule.bucketed.reducer.names[s.param] for s in b.slots]
        if b.compressed:
            assert b.codec.name == "qsgd4" and all("weight" in n for n in names)
            assert all(s.offset % 128 == 0 and s.padded % 128 == 0 for s in b.slots)
        else:  # biases, and the 60-element last weight (< min_compress_numel)
            assert b.codec.name == "none" and all("bias" in n or n.startswith("2.") for n in names)
        assert b.numel * 4 <= 0.01 * 2**20 or len(b.slots) == 1
        # the last layer first: buckets fill in (roughly) backward order
        assert [s.param for s in b.slots] == sorted((s.param for s in b.slots), reverse=True)
    plain = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), comm, bucket_cap_mb=0.01
    )
    assert plain.buckets[0].slots[0].param == 5 and all(not b.compressed for b in plain.buckets)


def test_overlap_sends_buckets_during_backward(comm):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), comm, bucket_cap_mb=0.0001
    )
    seen = []  # buckets on their way when the last gradient (the first layer's) arrives
    model[0].weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(opt.schedule.in_flight.issued)
    )
    loss(model, 0).backward()
    assert seen and seen[0] > 0 and len(opt.buckets) > 1, "buckets were sent during backward"
    # backward() returns with the averages in .grad (DDP's contract): nothing left in flight
    assert opt.schedule.in_flight is None and opt.schedule.averages.issued == len(opt.buckets)
    opt.step()
    off = create_multi_node_optimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1), comm, overlap=False
    )
    assert off.schedule.in_flight is None


def test_unused_parameters_with_and_without_zero_fill(comm):
    for zero_fill in (True, False):
        model = torch.nn.ModuleDict(
            {"used": torch.nn.Linear(3, 3), "unused": torch.nn.Linear(3, 3)}
        )
        before = params(model["unused"])
        opt = create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5),
            comm,
            zero_fill=zero_fill,
            model=model,
        )
        model["used"](torch.ones(2, 3)).sum().backward()
        opt.step()
        g = model["unused"].weight.grad
        if zero_fill:
            assert torch.equal(g, torch.zeros(3, 3))
            assert not torch.equal(model["unused"].weight, before[0]), (
                "weight decay applies to zeros"
            )
        else:
            assert g is None and torch.equal(model["unused"].weight, before[0])


def test_frozen_parameters_stay_without_gradient(comm):
    model = mlp()
    model[0].weight.requires_grad_(False)
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    loss(model, 0).backward()
    opt.step()
    assert model[0].weight.grad is None
    model[0].weight.requires_grad_(True)  # unfreezing rebuilds the buckets at the next step
    opt.zero_grad()
    loss(model, 1).backward()
    opt.step()
    assert model[0].weight.grad is not None
    assert sum(len(b.slots) for b in opt.buckets) == 4


def test_add_param_group_adds_hooks_and_buckets(comm):
    model = mlp()
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    head = torch.nn.Linear(3, 2)
    opt.add_param_group({"params": head.parameters(), "lr": 0.01})
    assert sum(len(b.slots) for b in opt.buckets) == 6
    head(model(data(0)[0])).sum().backward()
    assert opt.schedule.in_flight is None and opt.schedule.averages.issued == len(opt.buckets)
    opt.step()


# -- double buffering ----------------------------------------------------------------------------------
def test_double_buffering_is_exactly_one_step_stale(comm):
    lr = 0.1
    model, ref = mlp(), mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        comm,
        double_buffering="stale",
        bucket_cap_mb=0.001,
    )
    stale = None
    for step in range(5):
        ref.zero_grad()
        loss(ref, step).backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        with torch.no_grad():
            if stale is not None:
                for p, g in zip(ref.parameters(), stale):
                    p.add_(g, alpha=-lr)
        stale = grads
        opt.zero_grad()
        loss(model, step).backward()
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())), step
    assert opt.applied_steps == 4
    opt.flush()
    with torch.no_grad():
        for p, g in zip(ref.parameters(), stale):
            p.add_(g, alpha=-lr)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert opt.applied_steps == 5
    opt.flush()  # nothing pending: no-op
    assert opt.applied_steps == 5


def test_double_buffering_synchronize_exposes_the_gradients_to_apply(comm):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), comm, double_buffering="stale"
    )
    loss(model, 0).backward()
    g0 = [p.grad.clone() for p in model.parameters()]
    opt.step()  # first step: sends, applies nothing
    opt.zero_grad()
    loss(model, 1).backward()
    opt.synchronize()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), g0)), "step 0's gradients"
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    before = params(model)
    opt.step()
    moved = torch.cat([(a - b).reshape(-1) for a, b in zip(model.parameters(), before)]).norm()
    assert moved <= 0.1 * 1e-3 * 1.001, "the clipped gradients were applied"


def test_double_buffering_with_grad_scaler_needs_unscale_before_synchronize(comm):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), comm, double_buffering="stale"
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(loss(model, 0)).backward()
    opt.synchronize()
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.step(opt)


# -- non-finite gradients --------------------------------------------------------------------------------
def test_nonfinite_gradients_skip_the_step_and_are_reported(comm, caplog):
    model = mlp()
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    before = params(model)
    x, y = data(0)
    x[0, 0] = float("inf")
    torch.nn.functional.mse_loss(model(x), y).backward()
    with caplog.at_level(logging.WARNING, logger="commopt"):
        opt.step()
    assert opt.skipped_steps == 1 and opt.last_step_skipped and opt.applied_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert "skipped" in caplog.text
    opt.zero_grad()
    loss(model, 1).backward()
    opt.step()
    assert opt.applied_steps == 1 and not opt.last_step_skipped


# -- state dict ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(double_buffering="stale"),
        dict(compression="qsgd4+ef", algorithm="scatter_reduce"),
        dict(compression="qsgd4+ef", algorithm="scatter_reduce", double_buffering="stale"),
    ],
)
def test_state_dict_round_trip_continues_identically(comm, kwargs):
    def build(seed):
        model = mlp(seed)
        opt = create_multi_node_optimizer(
            torch.optim.Adam(model.parameters(), lr=0.01),
            comm,
            policy=CompressionPolicy(min_compress_numel=16),
            **kwargs,
        )
        return model, opt

    def train(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            loss(model, step).backward()
            opt.step()

    model, opt = build(0)
    train(model, opt, range(3))
    saved = pickle.loads(pickle.dumps({"model": model.state_dict(), "opt": opt.state_dict()}))
    if "compression" in kwargs:
        (codec_state,) = saved["opt"]["commopt"]["codec_state"].values()  # one plan part
        assert codec_state["compressed"]["residuals"]
    train(model, opt, range(3, 6))
    model2, opt2 = build(1)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(model2, opt2, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert opt2.applied_steps == opt.applied_steps


def test_load_state_dict_rejects_what_does_not_fit(comm):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        comm,
        compression="qsgd4+ef",
        algorithm="scatter_reduce",
        policy=CompressionPolicy(min_compress_numel=16),
    )
    loss(model, 0).backward()
    opt.step()
    sd = opt.state_dict()
    # a plain optimizer's state dict loads (no commopt part)
    opt.load_state_dict(opt.inner.state_dict())
    two_ranks = copy.deepcopy(sd)
    two_ranks["commopt"]["world_size"] = 2
    with pytest.raises(ValueError, match="same number of ranks"):
        opt.load_state_dict(two_ranks)
    other = copy.deepcopy(sd)
    (part,) = other["commopt"]["plans"].values()
    part["buckets"] = ["b0:1"]
    with pytest.raises(ValueError, match="bucket"):
        opt.load_state_dict(other)
    db_model = mlp()
    db = create_multi_node_optimizer(
        torch.optim.SGD(db_model.parameters(), lr=0.1), comm, double_buffering="stale"
    )
    loss(db_model, 0).backward()
    db.step()
    plain = create_multi_node_optimizer(torch.optim.SGD(db_model.parameters(), lr=0.1), comm)
    with pytest.raises(ValueError, match="double_buffering=True"):
        plain.load_state_dict(db.state_dict())


# -- bad input -------------------------------------------------------------------------------------------------
def test_wrapping_twice_or_a_non_optimizer_is_a_type_error(comm):
    opt = create_multi_node_optimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), comm)
    with pytest.raises(TypeError, match="already wrapped"):
        create_multi_node_optimizer(opt, comm)
    with pytest.raises(TypeError, match=r"torch.optim.Optimizer"):
        create_multi_node_optimizer(mlp(), comm)
    with pytest.raises(TypeError, match="Communicator"):
        create_multi_node_optimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), "mpi")
    with pytest.raises(TypeError, match="compression"):
        create_multi_node_optimizer(
            torch.optim.SGD(mlp().parameters(), lr=0.1), comm, compression=4
        )
    with pytest.raises(ValueError, match="unknown codec"):
        create_multi_node_optimizer(
            torch.optim.SGD(mlp().parameters(), lr=0.1), comm, compression="zip"
        )
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)
    assert isinstance(opt, MultiNodeOptimizer)


def test_allreduce_grad_dtype_picks_the_cast_codec(comm):
    opt = create_multi_node_optimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1), comm, allreduce_grad_dtype="float16"
    )
    assert {b.codec.name for b in opt.buckets} == {"fp16"}
    comm16 = commopt.create_communicator("local", allreduce_grad_dtype="bfloat16")
    opt = create_multi_node_optimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), comm16)
    assert {b.codec.name for b in opt.buckets} == {"bf16"}
    opt = create_multi_node_optimizer(
        torch.optim.SGD(mlp().parameters(), lr=0.1), comm16, allreduce_grad_dtype=torch.float32
    )
    assert {b.codec.name for b in opt.buckets} == {"none"}


def test_sparse_gradients_get_a_clear_error(comm):
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = create_multi_node_optimizer(torch.optim.SGD(emb.parameters(), lr=0.1), comm, model=emb)
    with pytest.raises(RuntimeError, match="sparse=False"):
        emb(torch.tensor([1, 2])).sum().backward()
    opt.close()


def test_second_backward_needs_no_sync(comm):
    model = mlp()
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    with opt.no_sync():
        loss(model, 0).backward()
    assert opt.schedule.in_flight is None, "no_sync sends nothing"
    loss(model, 1).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        loss(model, 2).backward()
