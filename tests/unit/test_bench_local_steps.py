"""The benchmarks' local-steps configurations on one rank: what they build, the bytes they send
on which steps, their cycle-mean time per step, the reports' bytes to the target, and
torchft's DiLoCo reported unavailable (with the pip command) where it does not import."""

import math
import sys

import pytest
import torch

import commopt
from commopt.bench import torchft_peer
from commopt.bench.step import configs
from commopt.bench.step.figures import robust_step, summarize
from commopt.bench.step.worker import cycle_blocks
from commopt.bench.to_accuracy_report import bytes_to, markdown
from commopt.bench.to_accuracy_report import summarize as tta_summarize
from recipes.text_lm.wide import WideCharMLP

C = configs.CONFIGS


def _model():
    torch.manual_seed(0)
    return WideCharMLP(vocab_size=40, context=4, embed=8, hidden=64)


def _train(name, steps):
    model = _model()
    opt = configs.wrap_commopt(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        commopt.create_communicator("local"),
        model,
        C[name],
    )
    x = torch.randint(0, 40, (8, 4))
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return model, opt


def test_configurations_parse_into_the_schedules_options():
    plain, ef = C["commopt-local-steps16"], C["commopt-local-steps16-qsgd4+ef"]
    stream, ft = C["commopt-local-steps16-stream-qsgd4+ef"], C["torchft-diloco16"]
    assert (plain.wire, plain.sync_every, plain.fragments, plain.overlap_steps) == (
        "fp32",
        16,
        1,
        0,
    )
    assert ef.wire == "qsgd4+ef" and C["commopt-local-steps32-qsgd4+ef"].sync_every == 32
    assert (stream.fragments, stream.overlap_steps) == (2, 1) and stream.cycle == 16
    assert ft.kind == "torchft" and ft.local_steps and ft.cycle == 16
    assert C["ddp-fp32"].cycle == 1 and not C["commopt-qsgd4+ef-db"].local_steps
    # the step benchmark's default list stays per-step; the local-steps ones are named
    assert not set(configs.STEP_DEFAULT_CONFIGS) & set(configs.LOCAL_STEPS_CONFIGS)
    assert "torchft-diloco16" in configs.LOCAL_STEPS_CONFIGS
    _, opt = _train("commopt-local-steps16-stream-qsgd4+ef", 1)
    try:
        (schedule,) = opt.plans.values()
        assert schedule.name == "local_steps"
        assert (schedule.sync_every, schedule.num_fragments, schedule.overlap_steps) == (16, 2, 1)
    finally:
        opt.close()


def test_local_steps_send_only_on_their_synchronising_steps():
    model, opt = _train("commopt-local-steps16-qsgd4+ef", 2)
    try:
        sent = [configs.commopt_sent_bytes(opt, t) for t in range(1, 33)]
        nonzero = [t for t, b in zip(range(1, 33), sent) if b]
        assert nonzero == [16, 32]
        (schedule,) = opt.plans.values()
        (fragment,) = schedule.fragments
        assert sent[15] == configs.reducer_wire_bytes(fragment.reducer)
        # the per-step figure is the mean over the cycle, not a silent step's zero
        assert configs.commopt_wire_bytes(opt) == round(sent[15] / 16)
        numel = sum(p.numel() for p in model.parameters())
        # 1/16 of the steps, and 4 bits for the large tensors (small ones stay fp32)
        assert 4 * numel / configs.commopt_wire_bytes(opt) > 16 * 4
        assert any(b.compressed for b in fragment.reducer.buckets)
    finally:
        opt.close()


def test_streaming_fragments_send_tau_steps_before_their_slot():
    _, opt = _train("commopt-local-steps16-stream-qsgd4+ef", 2)
    try:
        sent = {t: configs.commopt_sent_bytes(opt, t) for t in range(1, 33)}
        # fragment 0 synchronises at 8, 24 (sends at 7, 23), fragment 1 at 16, 32 (15, 31)
        assert [t for t, b in sent.items() if b] == [7, 15, 23, 31]
        assert sum(sent.values()) == 2 * sum(sent[t] for t in (7, 15))
        assert configs.commopt_wire_bytes(opt) == round((sent[7] + sent[15]) / 16)
    finally:
        opt.close()


def test_cycle_mean_arithmetic_on_synthetic_step_times():
    silent, sync = 0.1, 1.7  # 15 silent steps and one that synchronises
    cycle = [silent] * 15 + [sync]
    assert configs.cycle_mean(cycle * 3, 16) == pytest.approx((15 * silent + sync) / 16)
    # a cut-off cycle at the end is left out, whichever steps it holds
    assert configs.cycle_mean(cycle * 2 + [9.0] * 5, 16) == pytest.approx(0.2)
    assert configs.cycle_mean([silent] * 15, 16) is None
    with pytest.raises(ValueError, match="cycle"):
        configs.cycle_mean([1.0], 0)
    cfg = C["commopt-local-steps16"]
    assert configs.step_seconds(cfg, cycle * 2) == pytest.approx(0.2)
    assert configs.step_seconds(C["ddp-fp32"], cycle * 2) == pytest.approx(silent)  # the median
    # each round's cycle mean, then the median over rounds
    rounds = [{"step_times": cycle}, {"step_times": [0.3] * 16}, {"step_times": [5.0] * 16}]
    assert robust_step(rounds, cycle=16) == pytest.approx(0.3)
    assert robust_step(rounds) == pytest.approx(0.3)  # medians: 0.1, 0.3, 5.0
    assert cycle_blocks(cfg, 24, 4) == (32, 16)
    assert cycle_blocks(C["commopt-local-steps32-qsgd4+ef"], 6, 40) == (64, 64)


def test_the_step_reports_row_of_local_steps_is_the_cycle_mean():
    times = [0.1] * 15 + [1.7]
    rnd = {"step_times": times, "compute_times": [0.1], "backward_times": [0.05] * 16}
    results = {
        "ddp-fp32": {"rounds": [dict(rnd, step_times=[0.4] * 16)], "batch": 8, "wire_bytes": 1600},
        "commopt-local-steps16": {"rounds": [rnd], "batch": 8, "wire_bytes": 100},
    }
    rows = {r.config: r for r in summarize(results, 2, None)}
    assert rows["commopt-local-steps16"].step_s == pytest.approx(0.2)
    assert rows["commopt-local-steps16"].speedup == pytest.approx(2.0)


def _tta_report():
    fp32 = {
        "curve": [(0, 0.0, 4.0), (16, 8.0, 3.0), (32, 16.0, 2.0)],
        "step_times": [0.5] * 32,
        "wire_bytes": 1000,
    }
    every = [0] + [0] * 15 + [10] + [0] * 15 + [10] + [0] * 15 + [10]
    cumulative = [sum(every[: t + 1]) for t in range(49)]
    local = {
        "curve": [(0, 0.0, 4.0), (16, 2.0, 3.5), (32, 4.0, 2.5), (48, 6.0, 1.9)],
        "sent_bytes": [cumulative[t] for t in (0, 16, 32, 48)],
        "step_times": ([0.1] * 15 + [0.3]) * 3,
        "wire_bytes": round(10 / 16),
        "stopped": "target",
    }
    return {
        "command": "commopt bench to_accuracy",
        "link": "plain loopback",
        "nprocs": 2,
        "machine": "test",
        "load_average_start": 1.0,
        "date": "today",
        "budget": 32,
        "budget_factor": 2.0,
        "eval_every": 16,
        "tolerance": 0.0,
        "model": "m",
        "runs": {"ddp-fp32": fp32, "commopt-local-steps16-qsgd4+ef": local},
    }


def test_bytes_to_the_target_are_counted_on_the_steps_that_sent_them():
    report = _tta_report()
    local = report["runs"]["commopt-local-steps16-qsgd4+ef"]
    assert bytes_to(local, 48) == 30  # three synchronisations, not 48 x the mean per step
    assert bytes_to(report["runs"]["ddp-fp32"], 32) == 32_000  # no sent_bytes: per step x steps
    rows = {r["config"]: r for r in tta_summarize(report)}
    row = rows["commopt-local-steps16-qsgd4+ef"]
    assert row["steps_to_target"] == 48 and row["bytes_to_target"] == 30
    assert row["bytes_fewer_than_ddp_fp32"] == pytest.approx(32_000 / 30)
    assert row["median_step_s"] == pytest.approx((15 * 0.1 + 0.3) / 16)  # the cycle mean
    text = markdown(report, list(rows.values()))
    assert "cycle mean" in text and "x fewer bytes than DDP fp32" in text
    assert "sending 1067x fewer bytes to it than DDP fp32 (goal 100x: met)" in text


def test_a_local_steps_run_short_of_the_target_is_reported_not_met():
    report = _tta_report()
    local = report["runs"]["commopt-local-steps16-qsgd4+ef"]
    local["curve"][-1] = (48, 6.0, 2.2)
    rows = tta_summarize(report)
    assert "reached DDP fp32's target on 0 of 1 seed(s) within the budget factor: NOT met" in (
        markdown(report, rows)
    )


def test_torchft_missing_is_reported_unavailable_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    with pytest.raises(torchft_peer.TorchftUnavailable) as info:
        torchft_peer.require_torchft()
    message = str(info.value)
    assert message.startswith("unavailable:") and "pip install torchft==0.2.0" in message
    with pytest.raises(torchft_peer.TorchftUnavailable):
        torchft_peer.TorchftDiLoCo(
            _model(), None, commopt.create_communicator("local"), C["torchft-diloco16"], 0
        )
    # the report shows the row as unavailable and the run as a whole is not failed
    report = _tta_report()
    report["runs"]["torchft-diloco16"] = {"error": f"TorchftUnavailable: {message}"}
    rows = tta_summarize(report)
    assert "pip install torchft==0.2.0" in markdown(report, rows)
    assert not any(
        str(r.get("error", "")).startswith("exit code") for r in rows
    )  # what to_accuracy's exit status counts
    assert math.isfinite(rows[0]["target"])


def test_only_plain_local_steps_measure_the_schedule_and_one_fragment_the_outer_codec():
    from commopt.bench.to_accuracy_multipliers import ratios

    def row(name, steps):
        return {
            "config": name,
            "steps_to_target": steps,
            "seeds_reached": 1,
            "seeds_run": 1,
            "reached": True,
        }

    report = {
        "task": "text",
        "budget_factor": 3,
        "rows": [
            row("ddp-fp32", 100.0),
            row("commopt-local-steps16", 150.0),
            row("commopt-local-steps16-qsgd4+ef", 160.0),
            row("commopt-local-steps16-stream-qsgd4+ef", 170.0),
            row("torchft-diloco16", 150.0),
        ],
    }
    assert ratios(report) == [
        ("schedules", "local_steps:16", "text", 1.5, 1, False),
        ("outer_codecs", "qsgd4+ef", "text", pytest.approx(160 / 150), 1, False),
    ]


def test_to_accuracys_outer_lr_reaches_the_outer_optimizer():
    model = _model()
    opt = configs.wrap_commopt(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        commopt.create_communicator("local"),
        model,
        C["commopt-local-steps16-qsgd4+ef"],
        outer_lr=0.35,
    )
    try:
        model(torch.randint(0, 40, (8, 4))).sum().backward()
        opt.step()
        (schedule,) = opt.plans.values()
        assert [g["lr"] for f in schedule.fragments for g in f.outer.param_groups] == [0.35]
    finally:
        opt.close()
