"""The local-steps schedule on one rank: its options, its cycle, its state, its refusals.

(The multi-rank oracles, against the synchronous schedule and a K-replica reference written
from the DiLoCo equations, are in tests/distributed/test_local_steps.py.)
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import commopt
from commopt.optim.schedules.local_steps import LocalStepsSchedule, balanced_fragments, sync_steps


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _train(model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _opt(model, **kwargs):
    return commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        commopt.create_communicator("local"),
        model=model,
        schedule="local_steps",
        **kwargs,
    )


def test_the_options_reach_the_schedule():
    model = _model()
    opt = _opt(model, sync_every=8, fragments=2, overlap_steps=3, fragment_alpha=0.25)
    s = opt.schedule
    assert type(s) is LocalStepsSchedule
    assert (s.sync_every, s.num_fragments, s.overlap_steps, s.alpha) == (8, 2, 3, 0.25)
    assert list(opt.plans) == ["compression=None, schedule=local_steps"]
    _train(model, opt, range(1))
    (outer,) = {type(f.outer) for f in s.fragments}
    group = s.fragments[0].outer.param_groups[0]
    assert outer is torch.optim.SGD and (group["lr"], group["momentum"], group["nesterov"]) == (
        0.7,
        0.9,
        True,
    )


def test_an_outer_optimizer_factory_is_used_per_fragment():
    model = _model()
    opt = _opt(
        model,
        sync_every=2,
        fragments=2,
        outer_optimizer=functools.partial(torch.optim.Adam, lr=0.01),
    )
    _train(model, opt, range(4))
    assert [type(f.outer) for f in opt.schedule.fragments] == [torch.optim.Adam] * 2
    assert all(f.outer.state for f in opt.schedule.fragments)  # each stepped


def test_fragments_synchronise_on_a_staggered_cycle():
    assert sync_steps(0, 1, 4, 9) == [4, 8]
    assert sync_steps(0, 4, 8, 16) == [2, 10] and sync_steps(3, 4, 8, 16) == [8, 16]
    model = _model()
    opt = _opt(model, sync_every=4, fragments=2, overlap_steps=1)
    seen = []
    for step in range(8):
        _train(model, opt, [step])
        seen.append(opt.schedule.in_flight)
    # fragment 0 synchronises after steps 2 and 6, fragment 1 after 4 and 8; each reduction
    # starts one step before
    assert seen == [[0], [], [1], [], [0], [], [1], []]


def test_one_rank_with_plain_sgd_outer_steps_keeps_the_local_weights():
    # One rank, outer SGD lr 1 without momentum: anchor - (anchor - w) = w up to rounding.
    a, b = _model(), _model()
    opt = _opt(a, sync_every=3, outer_lr=1.0, outer_momentum=0.0)
    ref = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    _train(a, opt, range(7))
    _train(b, ref, range(7))
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.allclose(x, y, atol=1e-6), (x - y).abs().max()


def test_true_weights_shows_the_anchor_and_flush_applies_what_is_in_flight():
    model = _model()
    opt = _opt(model, sync_every=4, overlap_steps=2)
    _train(model, opt, range(3))  # sent after step 2, to be applied after step 4
    assert opt.schedule.in_flight == [0]
    local = [p.detach().clone() for p in model.parameters()]
    with opt.true_weights():
        inside = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), local))
    assert all(torch.equal(p, a) for p, a in zip(inside, opt.schedule.anchor))
    opt.flush()
    assert opt.schedule.in_flight == []
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), local))


def test_the_anchor_can_live_in_cpu_memory_with_the_same_result():
    a, b = _model(), _model()
    oa = _opt(a, sync_every=2, fragments=2, overlap_steps=1, compression="qsgd4+ef")
    ob = _opt(
        b, sync_every=2, fragments=2, overlap_steps=1, compression="qsgd4+ef", offload_anchor=True
    )
    _train(a, oa, range(7))
    _train(b, ob, range(7))
    assert all(t.device.type == "cpu" for t in ob.schedule.anchor)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_checkpoint_mid_cycle_resumes_exactly():
    def build():
        model = _model()
        return model, _opt(
            model, sync_every=4, fragments=2, overlap_steps=1, compression="qsgd4+ef"
        )

    m1, o1 = build()
    _train(m1, o1, range(5))  # fragment 0 sent after step 5, applied after step 6
    saved = copy.deepcopy({"model": m1.state_dict(), "opt": o1.state_dict()})
    (part,) = saved["opt"]["commopt"]["plans"].values()
    assert part["cycle"]["position"] == 5 and list(part["cycle"]["in_flight"]) == ["0"]
    assert "outer_residuals" in saved["opt"]["commopt"]["rank_keys"]
    _resumes_exactly(build, m1, o1, saved, range(5, 13))


def test_two_local_steps_parts_each_save_their_own_state_and_resume_exactly():
    # Per-group plans: the first layer's outer gradients in 4 bits with error feedback, the
    # rest exact; two local-steps parts, each with its residuals and inner state.
    def build():
        model = _model()
        return model, _opt(
            model, sync_every=3, plans=[("0.*", {"compression": "qsgd4+ef"})], outer_lr=0.5
        )

    m1, o1 = build()
    assert sorted(o1.plans) == [
        "compression=None, schedule=local_steps",
        "compression=qsgd4+ef, schedule=local_steps",
    ]
    _train(m1, o1, range(4))
    saved = copy.deepcopy({"model": m1.state_dict(), "opt": o1.state_dict()})
    keys = saved["opt"]["commopt"]["rank_keys"]
    assert sorted(keys) == sorted(f"{k}@{p}" for p in o1.plans for k in LocalStepsSchedule.own_keys)
    assert all(saved["opt"]["commopt"][f"local_state@{p}"] is not None for p in o1.plans)
    _resumes_exactly(build, m1, o1, saved, range(4, 11))


def _resumes_exactly(build, m1, o1, saved, steps) -> None:
    """``m1``/``o1`` train on through ``steps``; a fresh pair loaded from ``saved`` ends equal."""
    _train(m1, o1, steps)
    m2, o2 = build()
    m2.load_state_dict(saved["model"])
    o2.load_state_dict(saved["opt"])
    _train(m2, o2, steps)
    assert all(torch.equal(x, y) for x, y in zip(m1.parameters(), m2.parameters()))


@pytest.mark.parametrize("seed", range(20))
def test_balanced_fragments_place_every_tensor_once_within_one_tensor_of_each_other(seed):
    g = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 30, (1,), generator=g))
    sizes = torch.randint(0, 10_000, (count,), generator=g).tolist()
    parts = int(torch.randint(1, count + 1, (1,), generator=g))
    split = balanced_fragments(sizes, parts)
    assert len(split) == parts and all(split)  # every fragment holds a tensor
    assert sorted(i for m in split for i in m) == list(range(count))
    assert all(m == sorted(m) for m in split) and [m[0] for m in split] == sorted(
        m[0] for m in split
    )
    loads = [sum(sizes[i] for i in m) for m in split]
    assert max(loads) - min(loads) <= max(sizes)


def test_fragments_hold_near_equal_bytes_and_a_checkpoint_keeps_its_split():
    # Linear(4, 3) and Linear(3, 2): 48, 12, 24 and 8 bytes -> the first weight alone
    model = _model()
    params = list(model.parameters())
    opt = _opt(model, sync_every=4, fragments=2, overlap_steps=1)
    _train(model, opt, range(4))  # (no reduction in flight after step 4)
    schedule = opt.schedule
    assert [f.members for f in schedule.fragments] == [[0], [1, 2, 3]]
    assert all(all(p is params[i] for p, i in zip(f.params, f.members)) for f in schedule.fragments)
    assert all(a.shape == p.shape for a, p in zip(schedule.anchor, params))
    saved = copy.deepcopy(opt.state_dict())
    (part,) = saved["commopt"]["plans"].values()
    assert part["cycle"]["members"] == [[0], [1, 2, 3]]

    # a checkpoint holding another split (or none: tensor i in fragment i % 2) resumes with it
    for members, expected in (([[0, 1], [2, 3]], [[0, 1], [2, 3]]), (None, [[0, 2], [1, 3]])):
        state = copy.deepcopy(saved)
        (cycle_part,) = state["commopt"]["plans"].values()
        if members is None:
            del cycle_part["cycle"]["members"]
        else:
            cycle_part["cycle"]["members"] = members
        # (the outer optimizers' state as that split saved it: one state per fragment)
        cycle_part["outer_state"] = [
            torch.optim.SGD(
                [part["anchor"][i].clone() for i in m], lr=0.7, momentum=0.9, nesterov=True
            ).state_dict()
            for m in expected
        ]
        resumed = _opt(_model(), sync_every=4, fragments=2, overlap_steps=1)
        resumed.load_state_dict(state)
        assert [f.members for f in resumed.schedule.fragments] == expected
        assert all(torch.equal(a, b) for a, b in zip(resumed.schedule.anchor, part["anchor"]))

    state = copy.deepcopy(saved)
    (cycle_part,) = state["commopt"]["plans"].values()
    cycle_part["cycle"]["members"] = [[0], [1, 2]]
    with pytest.raises(ValueError, match="split of the local-steps part into fragments"):
        _opt(_model(), sync_every=4, fragments=2, overlap_steps=1).load_state_dict(state)


def test_a_checkpoint_of_another_cycle_is_refused():
    m1 = _model()
    o1 = _opt(m1, sync_every=4)
    _train(m1, o1, range(2))
    state = o1.state_dict()
    o2 = _opt(_model(), sync_every=5)
    with pytest.raises(ValueError, match="sync_every=4"):
        o2.load_state_dict(state)


def test_a_rank_with_nan_gradients_skips_its_inner_step_only():
    model = _model()
    opt = _opt(model, sync_every=4)
    _train(model, opt, range(1))
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.full((1, 4), float("nan"))).sum().backward()
    opt.step()
    assert opt.schedule.local_skipped_steps == 1 and opt.schedule.position == 2
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, "sync_every must be an integer >= 1"),
        ({"sync_every": 2.5}, "sync_every must be an integer"),
        ({"fragments": 0}, "fragments must be an integer >= 1"),
        ({"sync_every": 2, "fragments": 3}, "fragments=3 > sync_every=2"),
        ({"sync_every": 4, "overlap_steps": 4}, "overlap_steps=4 must be below sync_every=4"),
        ({"overlap_steps": -1}, "overlap_steps must be an integer >= 0"),
        ({"fragment_alpha": 1.5}, r"fragment_alpha must be a number in \[0, 1\]"),
        ({"outer_lr": float("nan")}, "outer_lr must be a finite number"),
        ({"outer_optimizer": "sgd"}, "outer_optimizer must be a callable"),
    ],
)
def test_bad_options_raise_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _opt(_model(), **kwargs)


def test_more_fragments_than_tensors_is_refused_at_the_first_step():
    model = _model()  # four tensors
    opt = _opt(model, sync_every=8, fragments=5)
    with pytest.raises(ValueError, match="fragments=5 but the local-steps part has 4"):
        _train(model, opt, range(1))


def test_closures_are_refused():
    model = _model()
    opt = _opt(model, sync_every=2)
    with pytest.raises(ValueError, match=r"local steps .* schedule=\"synchronous\" for closure"):
        opt.step(lambda: model(torch.ones(1, 4)).sum())


def test_grad_scaler_steps_every_rank_and_a_rank_with_inf_skips_only_its_inner_step():
    """GradScaler hands its scale over: step() runs on every rank whatever its gradients hold
    (the ranks' synchronisations stay in step), the gradients are unscaled exactly (a power
    of two), and Inf skips this rank's inner step only."""

    def run(scaler, inf_at=None):
        model = _model()
        opt = _opt(model, sync_every=2)
        calls = []
        opt.register_step_post_hook(lambda *_: calls.append(1))
        for step in range(6):
            opt.zero_grad()
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
                continue
            scaler.scale(loss).backward()
            if step == inf_at:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        opt.flush()
        return {k: v.clone() for k, v in model.state_dict().items()}, opt, len(calls)

    plain, _, _ = run(None)
    scaled, opt, calls = run(torch.amp.GradScaler("cpu", init_scale=2.0**10))
    assert calls == 6 and opt.schedule.local_skipped_steps == 0
    for k in plain:
        assert torch.equal(plain[k], scaled[k]), k
    _, opt, calls = run(torch.amp.GradScaler("cpu", init_scale=2.0**10), inf_at=3)
    assert calls == 6, "GradScaler skipped step() on this rank: its syncs would fall out of step"
    assert opt.schedule.local_skipped_steps == 1


def test_join_is_refused_with_what_to_do_instead():
    model = _model()
    with pytest.raises(ValueError, match="local_steps schedule does not reduce at every step"):
        commopt.Join(_opt(model, sync_every=2))
    sync = _model()
    commopt.Join(  # the synchronous schedule: accepted
        commopt.create_multi_node_optimizer(
            torch.optim.SGD(sync.parameters(), lr=0.1), commopt.create_communicator("local")
        )
    )


def test_bucket_view_gradients_and_accumulation_give_the_same_weights():
    def run(set_to_none, accumulate):
        model = _model()
        opt = _opt(model, sync_every=3, fragments=2, overlap_steps=1)
        for step in range(7):
            opt.zero_grad(set_to_none=set_to_none)
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
            if accumulate:  # two micro-batches, the first inside no_sync()
                with opt.no_sync():
                    (
                        torch.nn.functional.mse_loss(model(x[:3]), y[:3], reduction="sum") / 12
                    ).backward()
                (torch.nn.functional.mse_loss(model(x[3:]), y[3:], reduction="sum") / 12).backward()
            else:
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    plain = run(True, False)
    assert all(torch.equal(a, b) for a, b in zip(plain, run(False, False)))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, run(True, True)))


def test_final_sync_moves_the_weights_to_the_anchor_once_and_resumes_exactly():
    """final_sync() synchronises the fragments with steps since their last synchronisation
    (the weights become the anchor), leaves one that synchronised at this step alone (its
    outer momentum would move the anchor on a zero outer gradient), and the checkpoint knows
    which is which."""
    model = _model()
    opt = _opt(model, sync_every=4, fragments=2, overlap_steps=1)
    _train(model, opt, range(5))  # fragment 0 sent after step 5, due at 6: in flight
    s = opt.schedule
    assert s.in_flight == [0]
    saved = copy.deepcopy(opt.state_dict())
    anchor = [a.clone() for a in s.anchor]
    opt.final_sync()
    assert s.in_flight == []
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), s.anchor))
    assert not all(torch.equal(a, b) for a, b in zip(anchor, s.anchor)), "no outer step"
    after = [p.detach().clone() for p in model.parameters()]
    opt.final_sync()  # nothing since: nothing moves
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), after))

    resumed_model = _model(seed=3)
    resumed = _opt(resumed_model, sync_every=4, fragments=2, overlap_steps=1)
    _train(resumed_model, resumed, range(1))  # (the layout exists before loading)
    resumed.load_state_dict(saved)
    resumed.final_sync()
    assert all(torch.equal(a, b) for a, b in zip(resumed_model.parameters(), after))

    # at a step where the only fragment synchronised (no overlap): final_sync() changes nothing
    model = _model()
    opt = _opt(model, sync_every=3)
    _train(model, opt, range(6))
    before = [p.detach().clone() for p in model.parameters()]
    opt.final_sync()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), before))
    _train(model, opt, range(6, 7))
    opt.final_sync()
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), before))
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), opt.schedule.anchor))
