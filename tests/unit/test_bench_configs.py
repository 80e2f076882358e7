"""The benchmarks' configurations: compensated, warm-up, mixed plans and auto, on one rank."""

import pytest
import torch

import commopt
from commopt.bench.step import configs, floor
from recipes.text_lm.wide import WideCharMLP


def _model():
    torch.manual_seed(0)
    return WideCharMLP(vocab_size=40, context=4, embed=8, hidden=64)


def _wrap(name, model=None):
    model = model or _model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = configs.CONFIGS[name]
    return configs.wrap_commopt(inner, commopt.create_communicator("local"), model, cfg)


def test_new_configurations_and_the_step_benchmarks_default_list():
    c = configs.CONFIGS
    for wire in ("qsgd4+ef", "fp16", "powersgd4"):
        assert c[f"commopt-{wire}-comp"].double_buffering == configs.COMPENSATED
    assert c["ddp-powersgd1-warm"].powersgd_warmup and c["ddp-powersgd4-warm"].powersgd_rank == 4
    assert not c["ddp-powersgd1"].powersgd_warmup  # the existing ones stay
    assert c["commopt-qsgd4+ef-mixed"].mixed and c["commopt-qsgd4+ef-mixed"].double_buffering
    assert {
        c[n].double_buffering for n in ("commopt-auto", "commopt-auto-db", "commopt-auto-comp")
    } == {
        False,
        configs.STALE,  # -db: plain double buffering, as the results were measured
        configs.COMPENSATED,
    }
    default = set(configs.STEP_DEFAULT_CONFIGS)
    assert {"ddp-fp32", "commopt-qsgd4+ef-db", "commopt-powersgd4-db"} <= default
    assert not any(n.endswith(("-comp", "-warm", "-mixed")) or "auto" in n for n in default)


def test_powersgd_warmup_is_a_fraction_of_the_budget():
    warm, plain = configs.CONFIGS["ddp-powersgd1-warm"], configs.CONFIGS["ddp-powersgd1"]
    assert configs.powersgd_start_iter(warm, 150) == 15  # torch's suggested 10%
    assert configs.powersgd_start_iter(warm, 150, 0.2) == 30
    assert configs.powersgd_start_iter(warm, 6) == 2  # never below what the hook accepts
    assert configs.powersgd_start_iter(plain, 150) == configs.POWERSGD_START_ITER
    with pytest.raises(ValueError, match="fraction"):
        configs.powersgd_start_iter(warm, 150, 1.5)


def test_mixed_plan_puts_the_first_and_last_layers_on_the_synchronous_schedule():
    rules = configs.mixed_plan_rules(_model())
    assert rules == [
        ("embed.*", {"double_buffering": False}),
        ("net.4.*", {"double_buffering": False}),
    ]
    model = _model()
    opt = _wrap("commopt-qsgd4+ef-mixed", model)
    try:
        plans = list(opt.plans)
        assert plans == [
            "compression=qsgd4+ef, schedule=synchronous",
            "compression=qsgd4+ef, schedule=stale",
        ]
        sync = {id(p) for p in opt.plan_params(plans[0])}
        names = sorted(n for n, p in model.named_parameters() if id(p) in sync)
        assert names == ["embed.weight", "net.4.bias", "net.4.weight"]
    finally:
        opt.close()


def test_compensated_reduces_the_embedding_and_1d_tensors_synchronously_by_default():
    model = _model()
    opt = _wrap("commopt-qsgd4+ef-comp", model)
    try:
        assert list(opt.plans) == [
            "compression=qsgd4+ef, schedule=synchronous",
            "compression=qsgd4+ef, schedule=compensated",
        ]
        sync = {id(p) for p in opt.plan_params(next(iter(opt.plans)))}
        names = sorted(n for n, p in model.named_parameters() if id(p) in sync)
        assert names == ["embed.weight"] + sorted(
            n for n, p in model.named_parameters() if p.dim() == 1
        )
    finally:
        opt.close()


def test_wire_bytes_count_every_plans_buckets_with_their_own_parameters():
    sizes = {}
    for name in ("commopt-powersgd4", "commopt-powersgd4-comp", "commopt-powersgd4-mixed"):
        opt = _wrap(name)
        try:
            sizes[name] = configs.commopt_wire_bytes(opt)
        finally:
            opt.close()
    assert len(set(sizes.values())) == 1, sizes  # the same codec per tensor in every plan
    numel = sum(p.numel() for p in _model().parameters())
    assert sizes["commopt-powersgd4"] < 4 * numel


def test_codec_time_of_a_per_layer_plan_is_measured_from_its_buckets():
    opt = _wrap("commopt-powersgd4-mixed")
    try:
        per_layer = configs.StepConfig("x", "commopt", "auto", "x")
        shapes = [tuple(p.shape) for g in opt.param_groups for p in g["params"]]
        assert 0 < floor.codec_seconds(per_layer, shapes, 2, repeats=1, opt=opt) < 5
        with pytest.raises(ValueError, match="needs its optimizer"):
            floor.codec_seconds(per_layer, shapes, 2, repeats=1)
    finally:
        opt.close()
