"""What DDP scripts do between backward() and step(), in a world of one (the local communicator).

Gradient clipping in every mode (overlap on/off, double buffering), the built-in
``clip_grad_norm=``, Horovod's synchronize()/skip_synchronize(), GradScaler's unscale_ +
clip, and closure optimizers (LBFGS). Several ranks: tests/distributed/test_porting_from_ddp.py.
"""

import pytest
import torch

import commopt
from commopt.optim import create_multi_node_optimizer
from commopt.optim.clipping import GradWriteGuard, check_max_norm

LR, MAX_NORM = 0.1, 1e-3
MODES = {
    "overlap": {},
    "no-overlap": {"overlap": False},
    "double-buffering": {"double_buffering": "stale"},
}


@pytest.fixture
def comm():
    return commopt.create_communicator("local")


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def loss(model, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 5, generator=g), 100 * torch.randn(6, 3, generator=g)  # large gradients
    return torch.nn.functional.mse_loss(model(x), y)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def clipped_reference(steps, stale=False, clip_flush=True):
    """Plain SGD with clip_grad_norm_ (stale: the gradients of the step before, as double buffering).

    ``clip_flush=False``: the last gradients (double buffering's flush()) are applied unclipped.
    """
    ref = mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    pending = None
    for step in range(steps):
        opt.zero_grad()
        loss(ref, step).backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        if stale:
            grads, pending = pending, grads
            if grads is None:
                continue
        for p, g in zip(ref.parameters(), grads):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step()
    if stale:  # flush(): the last gradients
        for p, g in zip(ref.parameters(), pending):
            p.grad = g
        if clip_flush:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step()
    return ref


def test_clip_between_backward_and_step_applies_with_overlap(comm):
    """The default mode: .grad holds the averages when backward() returns, so a clip sticks."""
    model = mlp()
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=LR), comm)
    for step in range(3):
        opt.zero_grad()
        loss(model, step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        before = flat(model)
        opt.step()
        moved = (flat(model) - before).norm().item()
        assert moved <= LR * MAX_NORM * 1.001, (
            f"step {step}: the clip was lost (update norm {moved})"
        )
    assert torch.allclose(flat(model), flat(clipped_reference(3)), atol=1e-7)


@pytest.mark.parametrize("mode", ["no-overlap", "double-buffering"])
def test_clip_before_the_reduction_raises_naming_both_fixes(comm, mode):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=LR), comm, **MODES[mode]
    )
    loss(model, 0).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    with pytest.raises(RuntimeError, match=r"synchronize\(\).*skip_synchronize.*clip_grad_norm="):
        opt.step()
    # a gradient replaced rather than scaled in place is caught too
    opt.zero_grad()
    loss(model, 1).backward()
    model[0].bias.grad = torch.zeros_like(model[0].bias)
    with pytest.raises(RuntimeError, match=r"'0.bias'|param_groups"):
        opt.step()


@pytest.mark.parametrize("mode", list(MODES))
def test_synchronize_clip_skip_synchronize(comm, mode):
    """Horovod's pattern: the clip applies to the gradients step() applies, in every mode."""
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=LR), comm, **MODES[mode]
    )
    for step in range(3):
        opt.zero_grad()
        loss(model, step).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        with opt.skip_synchronize():
            opt.step()
    opt.flush()  # double buffering: the last gradients, which no user code clipped (clip_grad_norm= does)
    ref = clipped_reference(3, stale=mode == "double-buffering", clip_flush=False)
    assert torch.allclose(flat(model), flat(ref), atol=1e-7)


@pytest.mark.parametrize("mode", list(MODES))
def test_skip_synchronize_without_synchronize_raises(comm, mode):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=LR), comm, **MODES[mode]
    )
    if mode == "overlap":  # backward() itself averaged: nothing is left to synchronize
        loss(model, 0).backward()
        with opt.skip_synchronize():
            opt.step()
        assert opt.applied_steps == 1
        return
    loss(model, 0).backward()
    with (
        pytest.raises(RuntimeError, match=r"call optimizer.synchronize\(\)"),
        opt.skip_synchronize(),
    ):
        opt.step()


@pytest.mark.parametrize("mode", list(MODES))
def test_built_in_clip_grad_norm(comm, mode):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=LR), comm, clip_grad_norm=MAX_NORM, **MODES[mode]
    )
    for step in range(4):
        opt.zero_grad()
        loss(model, step).backward()
        opt.step()
    opt.flush()
    assert opt.last_grad_norm > 100 * MAX_NORM, "the norm before clipping is reported"
    ref = clipped_reference(4, stale=mode == "double-buffering")
    assert torch.allclose(flat(model), flat(ref), atol=1e-7)


def test_clip_grad_norm_argument_is_checked(comm):
    params = list(mlp().parameters())
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive"):
            create_multi_node_optimizer(torch.optim.SGD(params, lr=LR), comm, clip_grad_norm=bad)
    with pytest.raises(TypeError, match="clip_grad_norm"):
        check_max_norm("big")
    assert check_max_norm(None) is None and check_max_norm(2) == 2.0


@pytest.mark.parametrize("mode", ["overlap", "no-overlap"])
def test_grad_scaler_unscale_clip_step_as_in_the_amp_docs(comm, mode):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=LR), comm, **MODES[mode]
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(loss(model, step)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
    assert opt.applied_steps == 3
    assert torch.allclose(flat(model), flat(clipped_reference(3)), atol=1e-7)


def test_grad_scaler_with_double_buffering_and_built_in_clip(comm):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        comm,
        double_buffering="stale",
        clip_grad_norm=MAX_NORM,
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(4):
        opt.zero_grad()
        scaler.scale(loss(model, step)).backward()
        scaler.unscale_(opt)  # unscales this step's local gradients, before they are sent: allowed
        scaler.step(opt)
        scaler.update()
    opt.flush()
    assert torch.allclose(flat(model), flat(clipped_reference(4, stale=True)), atol=1e-6)


def test_grad_views_share_a_version_counter():
    """zero_grad(set_to_none=False) makes grads views of one bucket: one write flags the bucket."""
    bucket = torch.zeros(4)
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = bucket[:2], bucket[2:]
    guard = GradWriteGuard()
    guard.record([a, b])
    b.grad.mul_(2)
    assert guard.written([a, b], ["a", "b"]) == ["a", "b"]
    guard.clear()
    assert guard.written([a, b], ["a", "b"]) == []


def test_zero_grad_views_then_clip_raises_without_overlap(comm):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=LR), comm, overlap=False
    )
    loss(model, 0).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    loss(model, 1).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    with pytest.raises(RuntimeError, match="clip_grad_norm="):
        opt.step()


# -- closures --------------------------------------------------------------------------------------
def lbfgs_run(wrap, comm=None, steps=3, **options):
    model = mlp()
    inner = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=4)
    opt = create_multi_node_optimizer(inner, comm, **options) if wrap else inner
    losses = []
    for step in range(steps):

        def closure():
            opt.zero_grad()
            out = loss(model, step)
            out.backward()
            return out

        losses.append(float(opt.step(closure).detach()))
    return model, losses


@pytest.mark.parametrize("mode", ["overlap", "no-overlap"])
def test_lbfgs_closure_world_of_one_equals_plain_lbfgs(comm, mode):
    model, losses = lbfgs_run(True, comm, **MODES[mode])
    ref, ref_losses = lbfgs_run(False)
    assert losses == ref_losses
    assert torch.equal(flat(model), flat(ref))


def test_closure_with_double_buffering_is_refused(comm):
    model = mlp()
    opt = create_multi_node_optimizer(
        torch.optim.LBFGS(model.parameters()), comm, double_buffering="stale"
    )
    with pytest.raises(ValueError, match="double_buffering=False"):
        opt.step(lambda: loss(model, 0))


def test_second_backward_after_averaging_names_zero_grad_and_no_sync(comm):
    model = mlp()
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=LR), comm)
    loss(model, 0).backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\).*no_sync"):
        loss(model, 1).backward()
    opt.zero_grad()  # discards the averages not applied (e.g. a step GradScaler skipped)
    loss(model, 2).backward()
    opt.step()
    assert opt.applied_steps == 1


def test_grad_scaler_skipped_step_then_model_zero_grad(comm):
    """GradScaler skips opt.step() on overflow; model.zero_grad() must then start afresh."""
    model, ref = mlp(), mlp()
    opt = create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=LR), comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(3):
        model.zero_grad()
        out = loss(model, step) * (float("inf") if step == 1 else 1.0)
        scaler.scale(out).backward()
        scaler.step(opt)
        scaler.update()
        if step != 1:
            ref_opt.zero_grad()
            loss(ref, step).backward()
            ref_opt.step()
    assert opt.applied_steps == 2 and scaler.get_scale() == 2.0**7
    assert torch.allclose(flat(model), flat(ref), atol=1e-6)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_finishes_at_the_end_of_the_outer_backward(comm, reentrant):
    """Reentrant checkpointing runs inner backward passes: the averages must wait for all of them."""
    from torch.utils.checkpoint import checkpoint

    model, ref = mlp(), mlp()
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=LR), comm, bucket_cap_mb=1e-5
    )  # a bucket per tensor
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(2):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 5, generator=g), 100 * torch.randn(6, 3, generator=g)
        x.requires_grad_(reentrant)  # a reentrant checkpoint needs an input that requires grad
        hidden = checkpoint(lambda t: model[1](model[0](t)), x, use_reentrant=reentrant)
        out = checkpoint(model[2], hidden, use_reentrant=reentrant)
        torch.nn.functional.mse_loss(out, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        ref_opt.zero_grad()
        loss(ref, step).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
    assert torch.allclose(flat(model), flat(ref), atol=1e-7)
