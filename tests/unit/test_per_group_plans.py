"""Per-group plans on one rank (local communicator): which plan each parameter gets, what one
``step()`` applies from each plan, and the step applier, checkpoint, closures, GradScaler,
``no_sync()`` and ``true_weights()`` over mixed plans."""

import copy

import pytest
import torch

import commopt
from commopt.optim.plans import Plan, check_rules


@pytest.fixture
def comm():
    return commopt.create_communicator("local")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, idx):
        return self.fc(self.embed(idx)).sum()


def batch(step):
    return torch.arange(5) + step % 5


SYNC = "compression=None, schedule=synchronous"
DB = "compression=None, schedule=stale"


def test_group_keys_and_name_rules_choose_plans_and_buckets_never_mix(comm):
    model = Net()
    inner = torch.optim.SGD(
        [
            {"params": [model.embed.weight]},
            {"params": [model.fc.weight], "compression": "fp16"},
            {"params": [model.fc.bias]},
        ],
        lr=0.1,
    )
    opt = commopt.create_multi_node_optimizer(
        inner, comm, model=model, plans=[("fc.*", {"double_buffering": "stale"})]
    )
    assert list(opt.plans) == [
        SYNC,
        "compression=fp16, schedule=stale",  # the group's key wins over nothing else
        DB,
    ]
    assert opt.plan_params(SYNC) == [model.embed.weight]
    assert opt.plan_params(DB) == [model.fc.bias]
    assert opt.plans[DB].double_buffered and not opt.plans[SYNC].double_buffered
    assert len(opt.buckets) == 3, "each plan has its own buckets"


def test_bad_rules_and_two_compensated_plans_are_refused(comm):
    with pytest.raises(ValueError, match=r"plans\[0\] sets overlap"):
        check_rules([("x", {"overlap": False})])
    with pytest.raises(TypeError, match="pair"):
        check_rules(["x"])
    with pytest.raises(ValueError, match="double_buffering must be"):
        Plan(None, "later")
    model = Net()
    inner = torch.optim.SGD(
        [
            {"params": [model.embed.weight], "compression": "fp16"},
            {"params": list(model.fc.parameters())},
        ],
        lr=0.1,
    )
    with pytest.raises(ValueError, match="more than one compensated plan"):
        commopt.create_multi_node_optimizer(inner, comm, double_buffering="compensated")


def _mixed(comm, model, **kw):
    return commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        comm,
        model=model,
        plans=[("fc.*", {"double_buffering": "stale"})],
        **kw,
    )


def test_one_step_applies_this_steps_sync_average_and_the_previous_double_buffered_one(comm):
    model = Net()
    opt = _mixed(comm, model)
    grads = []
    for step in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        model(batch(step)).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        moved = {n: before[n] - p.detach() for n, p in model.named_parameters()}
        torch.testing.assert_close(moved["embed.weight"], 0.5 * grads[step]["embed.weight"])
        for n in ("fc.weight", "fc.bias"):
            expected = torch.zeros_like(moved[n]) if step == 0 else 0.5 * grads[step - 1][n]
            torch.testing.assert_close(moved[n], expected)
    assert opt.applied_steps == 3 and opt.skipped_steps == 0
    fc_before = model.fc.weight.detach().clone()
    opt.flush()
    torch.testing.assert_close(fc_before - model.fc.weight.detach(), 0.5 * grads[2]["fc.weight"])


def test_clip_is_one_global_norm_over_what_the_step_applies(comm):
    model = Net()
    opt = _mixed(comm, model, clip_grad_norm=1e-3)
    model(batch(0)).backward()
    first = model.embed.weight.grad.norm().item()  # only the synchronous plan applies now
    opt.step()
    assert opt.last_grad_norm == pytest.approx(first, rel=1e-5)
    opt.zero_grad()
    model(batch(1)).backward()
    fc_sent = torch.cat([p.grad.flatten() for p in model.fc.parameters()])  # applied next step
    opt.step()
    opt.zero_grad()
    model(batch(2)).backward()
    embed_now = model.embed.weight.grad.flatten().clone()
    opt.step()
    both = torch.cat([embed_now, fc_sent]).norm().item()
    assert float(opt.last_grad_norm) == pytest.approx(both, rel=1e-5)


def test_nan_in_one_plan_skips_every_plan_of_that_step(comm):
    model = Net()
    opt = _mixed(comm, model)
    hook = model.fc.bias.register_hook(lambda g: g * float("nan"))  # before accumulation
    model(batch(0)).backward()  # fc.bias is double-buffered: applied (skipped) at step 1
    hook.remove()
    opt.step()
    assert not opt.last_step_skipped and opt.applied_steps == 1
    opt.zero_grad()
    embed = model.embed.weight.detach().clone()
    model(batch(1)).backward()
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert torch.equal(model.embed.weight, embed), "the synchronous plan stepped anyway"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _train(model, opt, steps):
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)
        model(batch(step)).backward()
        opt.step()


@pytest.mark.parametrize("db", ["stale", "compensated"])
def test_checkpoint_is_keyed_by_plan_and_resumes_exactly(comm, db):
    def build():
        model = Net()
        opt = commopt.create_multi_node_optimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01),
            comm,
            model=model,
            compression="qsgd4+ef",
            double_buffering=db,
            plans=[("embed.*", {"double_buffering": False, "compression": None})],
        )
        return model, opt

    model, opt = build()
    _train(model, opt, range(4))
    sd = copy.deepcopy(opt.state_dict())
    with opt.true_weights():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert sorted(sd["commopt"]["plans"]) == sorted(opt.plans)
    assert sorted(sd["commopt"]["codec_state"]) == sorted(opt.plans)
    saved_model = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, opt, range(4, 8))
    opt.flush()
    model2, opt2 = build()
    with torch.no_grad():
        for n, p in model2.named_parameters():
            p.copy_(saved_model[n])
    opt2.load_state_dict(sd)
    with opt2.true_weights():
        for n, p in model2.named_parameters():
            assert torch.equal(p, weights[n]), n
    _train(model2, opt2, range(4, 8))
    opt2.flush()
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), f"{n} differs after resuming"
    one_plan = commopt.create_multi_node_optimizer(
        torch.optim.AdamW(Net().parameters(), lr=0.01), comm
    )
    with pytest.raises(ValueError, match="several plans"):
        one_plan.load_state_dict(sd)


def test_closures_work_across_synchronous_plans_and_are_refused_with_double_buffering(comm):
    model = Net()
    inner = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    opt = commopt.create_multi_node_optimizer(
        inner, comm, model=model, plans=[("fc.*", {"compression": "fp16"})]
    )
    assert len(opt.plans) == 2

    def closure():
        opt.zero_grad()
        loss = model(batch(0))
        loss.backward()
        return loss

    before = model.fc.weight.detach().clone()
    opt.step(closure)
    assert not torch.equal(before, model.fc.weight) and opt.applied_steps == 1
    opt_db = _mixed(comm, Net())
    with pytest.raises(ValueError, match="double_buffering=False for closure"):
        opt_db.step(closure)


def test_grad_scaler_over_a_synchronous_and_a_double_buffered_plan(comm):
    def run(scaled):
        model = Net()
        opt = _mixed(comm, model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=scaled)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(model(batch(step))).backward()
            scaler.step(opt)
            scaler.update()
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b)


def test_no_sync_accumulates_in_every_plan(comm):
    def run(accumulate):
        model = Net()
        opt = _mixed(comm, model)
        for step in range(3):
            opt.zero_grad()
            if accumulate:
                with opt.no_sync():
                    model(batch(step)).backward()
                model(batch(step + 1)).backward()
            else:
                (model(batch(step)) + model(batch(step + 1))).backward()
            opt.step()
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b)


def test_compensation_predicts_only_its_own_plan(comm):
    model = Net()
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        comm,
        model=model,
        double_buffering="compensated",
        plans=[("embed.*", {"double_buffering": False})],
    )
    _train(model, opt, range(2))
    predicted = {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.true_weights():
        true = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert torch.equal(predicted["embed.weight"], true["embed.weight"])
    assert not torch.equal(predicted["fc.weight"], true["fc.weight"])
    opt.flush()
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.hidden = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight  # tied output projection

    def forward(self, idx):
        return self.out(torch.tanh(self.hidden(self.embed(idx)))).sum()


COMP = "compression=None, schedule=compensated"


def test_compensated_reduces_embeddings_tied_weights_and_1d_tensors_synchronously_by_default(
    comm, caplog
):
    model = Tied()
    with caplog.at_level("INFO", logger="commopt"):
        opt = commopt.create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            comm,
            model=model,
            double_buffering="compensated",
        )
        _train(model, opt, range(2))
        added = torch.nn.Parameter(torch.zeros(2))  # a 1-D tensor added later: the rule too
        opt.add_param_group({"params": [added]})
        matrix = torch.nn.Parameter(torch.zeros(2, 2))
        opt.add_param_group({"params": [matrix]})
    assert list(opt.plans) == [SYNC, COMP]
    # (the tied out.weight is the same tensor as embed.weight)
    assert opt.plan_params(SYNC) == [model.embed.weight, model.hidden.bias, added]
    assert opt.plan_params(COMP) == [model.hidden.weight, matrix]
    assert opt.plans[SYNC].overlap
    logged = [r for r in caplog.records if "synchronously" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert "embed.weight" in logged[0].getMessage() and "hidden.bias" in logged[0].getMessage()

    def wrapped(**kw):
        m = Tied()
        opt = commopt.create_multi_node_optimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            comm,
            model=m,
            double_buffering=kw.pop("db", "compensated"),
            **kw,
        )
        return m, opt

    def plans_of(**kw):
        return list(wrapped(**kw)[1].plans)

    assert plans_of(synchronous_embeddings=False, synchronous_vectors=False) == [COMP]
    m, only_vectors = wrapped(synchronous_embeddings=False)
    assert only_vectors.plan_params(SYNC) == [m.hidden.bias]
    m, only_tables = wrapped(synchronous_vectors=False)
    assert only_tables.plan_params(SYNC) == [m.embed.weight]
    assert plans_of(
        plans=[("embed.*", {"double_buffering": "compensated"})], synchronous_vectors=False
    ) == [COMP]
    assert plans_of(plans=[("*", {"double_buffering": "compensated"})]) == [COMP], (
        "a rule wins over the default rule"
    )
    assert plans_of(db="stale") == [DB], "the rule is compensated double buffering's only"
