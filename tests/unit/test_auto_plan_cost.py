"""``compression="auto"``'s cost model: the step multipliers' table, the command that writes it
from result files (synthetic ones here), the choices the multipliers drive, local steps as a
candidate, and the plan's expected times in its JSON and the wrapper's log and checkpoint."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import commopt
from commopt.optim import schedules, step_multipliers
from commopt.optim.auto_plan import CODEC_SECONDS_PER_ELEMENT, AutoPlan, AutoPlanner, TensorInfo
from commopt.optim.step_multipliers import TABLE_PATH, StepMultipliers

GBIT = 125e6
ROOT = Path(__file__).resolve().parents[2]
FREE = dict.fromkeys(CODEC_SECONDS_PER_ELEMENT, 0.0)  # no codec time
BIG = [TensorInfo("w", (4096, 4096)), TensorInfo("b", (4096,), compressible=False)]


def table(codecs=None, schedules_=None, outer=None):
    """Every codec at 1x the steps but ``codecs``; outer gradients: ``outer``, by default
    every elementwise codec at its per-step multiplier (no low-rank one)."""
    entries = {"qsgd8": 1.0, "bf16": 1.0, "qsgd4+ef": 1.0, "qsgd2+ef": 1.0}
    entries.update({f"powersgd{r}": 1.0 for r in (1, 2, 4)})
    entries.update(codecs or {})
    if outer is None:
        outer = {k: v for k, v in entries.items() if not k.startswith("powersgd")}
    return StepMultipliers.from_dict(
        {
            "codecs": {k: {"multiplier": v} for k, v in entries.items()},
            "schedules": {k: {"multiplier": v} for k, v in (schedules_ or {}).items()},
            "outer_codecs": {k: {"multiplier": v} for k, v in outer.items()},
        }
    )


def test_the_package_table_loads_and_names_a_source_for_every_entry():
    data = json.loads(TABLE_PATH.read_text())
    loaded = StepMultipliers.load()
    for option in ("bf16", "fp16", "qsgd8", "qsgd4+ef", "qsgd2+ef", "qsgd4", "qsgd2"):
        assert loaded.codec(option) >= 1.0
    for option in ("powersgd1", "powersgd2", "powersgd4"):
        assert loaded.codec(option) > 1.0
    assert loaded.schedule("stale") > 1.0 and loaded.schedule("compensated") >= 1.0
    assert loaded.outer_codec("qsgd4+ef") >= 1.0
    for option in ("powersgd1", "powersgd2", "powersgd4"):
        assert loaded.outer_codec(option) is None  # low rank never carries outer gradients
    for section in ("codecs", "schedules", "outer_codecs"):
        for name, entry in data[section].items():
            assert entry["source"].startswith(("measured: ", "estimate: ")), name
            if entry["source"].startswith("measured: "):
                for path in entry["source"].removeprefix("measured: ").split(", "):
                    assert (ROOT / path).exists(), (name, path)


def test_multipliers_floor_at_one_interpolate_local_steps_and_refuse_what_they_lack(tmp_path):
    t = table({"qsgd8": 0.9}, {"local_steps:2": 1.2, "local_steps:8": 1.8})
    assert t.codec("qsgd8") == 1.0  # fewer steps than fp32: noise
    assert t.local_steps(1) == 1.0 and t.local_steps(2) == 1.2
    assert t.local_steps(4) == pytest.approx(1.5)  # halfway in log2 between 2 and 8
    assert t.local_steps(16) is None  # beyond the table: not priced
    assert t.schedule("synchronous") == 1.0 and t.schedule("unpriced") == 1.0
    with pytest.raises(ValueError, match="no entry for the codec 'zip9'"):
        t.codec("zip9")
    bad = tmp_path / "bad.json"
    bad.write_text('{"codecs": {"qsgd8": {"multiplier": -1}}, "schedules": {}}')
    with pytest.raises(ValueError, match="write-multipliers"):
        StepMultipliers.load(bad)


def test_the_multipliers_drive_the_choice():
    """One matrix, a link too slow for its exact gradient under the backward pass: with every
    multiplier 1 any option that hides the wire is as good (the step is compute); when the
    codecs cost steps the planner takes the one of least expected time, bf16 with 0.07 s
    exposed (0.47 s) losing to qsgd4+ef hidden at 1.1x (0.44 s) and qsgd8 at 1.3x (0.52 s);
    when every codec costs 10x the steps, exact."""
    free = AutoPlanner(multipliers=table(), codec_overlaps=False, codec_seconds_per_element=FREE)
    chosen = free.plan(BIG, link_rate=GBIT, backward_s=0.2, step_s=0.4)
    assert chosen.choices["w"] != "none" and chosen.fits
    assert chosen.expected_s["chosen"] == pytest.approx(0.4)
    steps = {"qsgd8": 1.3, "qsgd4+ef": 1.1, "powersgd4": 1.6, "powersgd2": 2.0}
    steps.update({"powersgd1": 3.0, "qsgd2+ef": 2.0})
    priced = AutoPlanner(
        multipliers=table(steps), codec_overlaps=False, codec_seconds_per_element=FREE
    )
    chosen = priced.plan(BIG, link_rate=GBIT, backward_s=0.2, step_s=0.4)
    assert chosen.choices == {"w": "qsgd4+ef", "b": "none"}, chosen.choices
    numel = sum(t.numel for t in BIG)
    assert chosen.expected_s["chosen"] == pytest.approx(0.4 * (1 + 0.1 * 4096 * 4096 / numel))
    costly = table(dict.fromkeys(table().codecs, 10.0))
    keep = AutoPlanner(multipliers=costly, codec_overlaps=False, codec_seconds_per_element=FREE)
    chosen = keep.plan(BIG, link_rate=GBIT, backward_s=0.2, step_s=0.4)
    assert set(chosen.choices.values()) == {"none"} and not chosen.fits
    assert chosen.expected_s["chosen"] == chosen.expected_s["exact"]


def test_the_schedule_multiplier_counts_for_the_double_buffered_tensors():
    db = [dataclasses.replace(t, double_buffered=True) for t in BIG]
    planner = AutoPlanner(multipliers=table(schedules_={"stale": 1.5}), codec_overlaps=False)
    stale = planner.plan(db, link_rate=1e12, backward_s=0.2, step_s=0.4, schedule="stale")
    sync = planner.plan(db, link_rate=1e12, backward_s=0.2, step_s=0.4)
    assert stale.expected_s["chosen"] == pytest.approx(0.4 * 1.5)
    assert sync.expected_s["chosen"] == pytest.approx(0.4)
    assert stale.inputs["multiplier.schedule.stale"] == 1.5


def test_local_steps_are_a_candidate_only_where_priced_and_win_only_when_sooner():
    vectors = [TensorInfo(f"v{i}", (1 << 20,)) for i in range(4)]  # 16 MB exact
    t = table(dict.fromkeys(("qsgd8", "bf16", "qsgd4+ef", "qsgd2+ef"), 4.0), {"local_steps:8": 1.3})
    planner = AutoPlanner(multipliers=t, codec_overlaps=False, codec_seconds_per_element=FREE)
    slow = planner.plan(vectors, link_rate=GBIT, backward_s=0.02, step_s=0.05, local_steps=8)
    # per step: 0.05 s + 0.134 s of exposed wire exact, 4x the steps compressed; local steps:
    # (0.05 + 0.134 / 8) x 1.3 = 0.087 s.
    assert slow.schedule == "local_steps" and set(slow.choices.values()) == {"none"}
    assert slow.expected_s["chosen"] == slow.expected_s["local_steps"]
    assert slow.expected_s["local_steps"] == pytest.approx((0.05 + (16 << 20) / GBIT / 8) * 1.3)
    fast = planner.plan(vectors, link_rate=1e12, backward_s=0.02, step_s=0.05, local_steps=8)
    assert fast.schedule is None and fast.expected_s["local_steps"] > fast.expected_s["chosen"]
    unpriced = planner.plan(vectors, link_rate=GBIT, backward_s=0.02, step_s=0.05, local_steps=64)
    assert unpriced.schedule is None and "local_steps" not in unpriced.expected_s
    none = planner.plan(vectors, link_rate=GBIT, backward_s=0.02, step_s=0.05)
    assert none.schedule is None and "local_steps" not in none.expected_s


def test_local_steps_price_their_outer_gradients_with_each_option_and_take_the_cheapest():
    # 4-bit QSGD + EF costs no steps here, low rank 4x: per step the 4-bit wire (67 ms at 1
    # Gbit/s) is exposed beyond the backward pass; every 8 steps it is 8 ms a step.
    slow = dict.fromkeys(("powersgd1", "powersgd2", "powersgd4", "qsgd2+ef"), 4.0)
    t = table(slow, {"local_steps:8": 1.3})
    planner = AutoPlanner(multipliers=t, codec_overlaps=False, codec_seconds_per_element=FREE)
    plan = planner.plan(BIG, link_rate=GBIT, backward_s=0.02, step_s=0.05, local_steps=8)
    assert plan.schedule == "local_steps"
    assert plan.choices == {"w": "qsgd4+ef", "b": "none"}  # the bias cannot be compressed
    wire = planner.wire_bytes("qsgd4+ef", BIG[0]) + 4096 * 4
    assert plan.wire_bytes == {"w": wire - 4096 * 4, "b": 4096 * 4}
    assert plan.expected_s["local_steps"] == pytest.approx((0.05 + wire / GBIT / 8) * 1.3)
    exact_local = (0.05 + (4096 * 4097 * 4) / GBIT / 8) * 1.3
    # exact outer gradients (152 ms) would lose to the best per-step plan (101 ms)
    assert plan.expected_s["local_steps"] < plan.expected_s["per_step"] < exact_local
    # where the link is fast, exact outer gradients cost nothing more: per step wins
    fast = planner.plan(BIG, link_rate=1e12, backward_s=0.02, step_s=0.05, local_steps=8)
    assert fast.schedule is None


def test_streaming_local_steps_price_the_wire_their_overlap_hides():
    # 4 exact vectors of 4 MB (34 ms each at 1 Gbit/s), 2 fragments of two each (67 ms of
    # wire): overlapping 1 step (50 ms) leaves 17 ms of each fragment exposed, 3 steps none.
    vectors = [TensorInfo(f"v{i}", (1 << 20,)) for i in range(4)]
    t = table(dict.fromkeys(("qsgd8", "bf16", "qsgd4+ef", "qsgd2+ef"), 4.0), {"local_steps:8": 1.3})
    planner = AutoPlanner(multipliers=t, codec_overlaps=False, codec_seconds_per_element=FREE)
    kw = dict(link_rate=GBIT, backward_s=0.02, step_s=0.05, local_steps=8)
    fragment = 2 * (4 << 20) / GBIT
    plain = planner.plan(vectors, **kw)
    assert plain.expected_s["local_steps"] == pytest.approx((0.05 + 2 * fragment / 8) * 1.3)
    one = planner.plan(vectors, **kw, local_fragments=2, local_overlap=1)
    exposed = 2 * (fragment - 0.05)
    assert one.expected_s["local_steps"] == pytest.approx((0.05 + exposed / 8) * 1.3)
    three = planner.plan(vectors, **kw, local_fragments=2, local_overlap=3)
    assert three.expected_s["local_steps"] == pytest.approx(0.05 * 1.3)
    assert three.inputs["local_fragments"] == 2 and three.inputs["local_overlap"] == 3
    # one fragment: the whole transfer (134 ms) behind 1 step of overlap
    whole = planner.plan(vectors, **kw, local_overlap=1)
    assert whole.expected_s["local_steps"] == pytest.approx(
        (0.05 + (2 * fragment - 0.05) / 8) * 1.3
    )
    # codec time on the CPU takes compute's cores: it never hides. Every codec costs 0.17 s
    # on this matrix; 7 steps of overlap hide any compressed wire, not exact fp32's 0.54 s.
    costs = {**dict.fromkeys(CODEC_SECONDS_PER_ELEMENT, 1e-8), "none": 0.0}
    costly = AutoPlanner(
        multipliers=table(schedules_={"local_steps:8": 1.3}),
        codec_overlaps=False,
        codec_seconds_per_element=costs,
    ).plan([TensorInfo("w", (4096, 4096))], **kw, local_overlap=7)
    codec = 1e-8 * 4096 * 4096
    assert costly.expected_s["local_steps"] == pytest.approx((0.05 + codec / 8) * 1.3)


def test_outer_gradients_go_only_with_options_priced_for_them():
    # Low rank's wire is the smallest, but the table prices no low-rank outer gradients (a
    # rank-4 outer gradient keeps a few directions of H steps' progress): local steps send the
    # outer gradients in 4 bits, priced at their own outer multiplier (1.2x), not at the
    # per-step one (3x, as every per-step option here).
    t = table(
        dict.fromkeys(
            ("qsgd4+ef", "qsgd8", "bf16", "qsgd2+ef", "powersgd1", "powersgd2", "powersgd4"), 3.0
        ),
        {"local_steps:8": 1.3},
        outer={"qsgd4+ef": 1.2},
    )
    planner = AutoPlanner(multipliers=t, codec_overlaps=False, codec_seconds_per_element=FREE)
    plan = planner.plan(BIG, link_rate=GBIT, backward_s=0.02, step_s=0.05, local_steps=8)
    assert plan.schedule == "local_steps" and plan.choices["w"] == "qsgd4+ef", plan.choices
    wire = planner.wire_bytes("qsgd4+ef", BIG[0]) + 4096 * 4
    numel = sum(t.numel for t in BIG)
    mass = (4096 * 4096 * 1.2 + 4096) / numel
    assert plan.expected_s["local_steps"] == pytest.approx((0.05 + wire / (GBIT) / 8) * 1.3 * mass)
    assert plan.inputs["multiplier.outer.qsgd4+ef"] == 1.2
    # without any priced codec the outer gradients travel exact
    exact = AutoPlanner(
        multipliers=table({"qsgd4+ef": 3.0}, {"local_steps:8": 1.3}, outer={}),
        codec_overlaps=False,
        codec_seconds_per_element=FREE,
    ).plan(BIG, link_rate=GBIT, backward_s=0.02, step_s=0.05, local_steps=8)
    assert exact.schedule != "local_steps" or set(exact.choices.values()) == {"none"}


def test_the_plans_json_keeps_its_schedule_and_expected_times_and_reads_older_plans():
    planner = AutoPlanner(multipliers=table(schedules_={"local_steps:4": 1.1}))
    chosen = planner.plan(BIG, link_rate=1e6, backward_s=0.01, step_s=0.02, local_steps=4)
    assert AutoPlan.from_json(chosen.to_json()) == chosen
    assert "expected time to the target" in chosen.summary()
    older = json.loads(chosen.to_json())
    del older["schedule"], older["expected_s"]
    old = AutoPlan.from_json(json.dumps(older))
    assert old.schedule is None and old.expected_s == {} and old.choices == chosen.choices


def _synthetic_report(task, rows, budget_factor=2.0):
    return {"task": task, "budget_factor": budget_factor, "rows": rows, "runs": {}}


def _row(config, steps, seeds=1, reached=True):
    return {
        "config": config,
        "reached": reached,
        "steps_to_target": steps if reached else None,
        "seeds_run": seeds,
        "seeds_reached": seeds if reached else 0,
    }


def test_write_multipliers_from_synthetic_result_files(tmp_path):
    text = _synthetic_report(
        "text",
        [
            _row("ddp-fp32", 100.0),
            _row("ddp-fp16", 100.0),
            _row("ddp-powersgd4-warm", 150.0),
            _row("ddp-powersgd4", 400.0),  # no warm-up: measures nothing
            _row("ddp-powersgd1-warm", None, reached=False),
            _row("commopt-qsgd4+ef", 110.0),
            _row("commopt-qsgd4+ef-db", 165.0),
            _row("commopt-qsgd4+ef-comp", 110.0),
            _row("commopt-auto", 90.0),  # auto measures nothing
            _row("commopt-local-steps16", 160.0),
            _row("commopt-local-steps16-qsgd4+ef", 176.0),  # outer gradients: 1.1x exact
            _row("commopt-local-steps16-stream-qsgd4+ef", 400.0),  # streaming: nothing
        ],
    )
    digits = _synthetic_report(
        "digits",
        [_row("ddp-fp32", 100.0, 2), _row("commopt-qsgd4+ef", 130.0, 2)],
    )
    digits_more = _synthetic_report(
        "digits", [_row("ddp-fp32", 100.0), _row("commopt-qsgd4+ef", 100.0)]
    )
    paths = []
    for name, report in (("t.json", text), ("d.json", digits), ("d2.json", digits_more)):
        (tmp_path / name).write_text(json.dumps(report))
        paths += ["--from-json", str(tmp_path / name)]
    out = tmp_path / "multipliers.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "commopt", "bench", "to_accuracy", *paths]
    done = subprocess.run(
        [*cmd, "--write-multipliers", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    codecs, scheds = written["codecs"], written["schedules"]
    assert codecs["fp16"]["measured"] == {"text": 1.0}
    assert codecs["powersgd4"]["multiplier"] == 1.5
    assert codecs["powersgd1"]["multiplier"] == 2.0 and codecs["powersgd1"]["censored"] == ["text"]
    # digits: 1.3 on 2 seeds, 1.0 on 1 -> 1.2; text 1.1; the mean over the tasks 1.15
    assert codecs["qsgd4+ef"]["measured"] == {"digits": 1.2, "text": 1.1}
    assert codecs["qsgd4+ef"]["multiplier"] == pytest.approx(1.15)
    assert str(tmp_path / "t.json") in codecs["qsgd4+ef"]["source"]
    assert scheds["stale"]["multiplier"] == 1.5 and scheds["compensated"]["multiplier"] == 1.0
    assert scheds["local_steps:16"]["measured"] == {"text": 1.6}
    assert written["outer_codecs"]["qsgd4+ef"]["measured"] == {"text": 1.1}
    package_outer = json.loads(TABLE_PATH.read_text())["outer_codecs"]
    assert written["outer_codecs"]["bf16"] == package_outer["bf16"]
    # entries no file measures keep the package's estimate and its source
    package = json.loads(TABLE_PATH.read_text())
    assert codecs["qsgd8"] == package["codecs"]["qsgd8"]
    assert scheds["local_steps:4"] == package["schedules"]["local_steps:4"]
    assert StepMultipliers.load(out).codec("powersgd4") == 1.5
    refused = subprocess.run(
        [sys.executable, "-m", "commopt", "bench", "to_accuracy", "--write-multipliers", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "--from-json" in refused.stderr


def _package_table(tmp_path, monkeypatch, cheap=()) -> None:
    """The package's table with every codec at 10x the steps but ``cheap`` (1x) and
    ``local_steps:16`` at 1.1x: local steps win on a slow link."""
    assert "local_steps" in schedules.SCHEDULES  # the local-steps schedule
    data = json.loads(TABLE_PATH.read_text())
    for section in ("codecs", "outer_codecs"):
        for name, entry in data[section].items():
            entry["multiplier"] = 1.0 if name in cheap else 10.0
    data["schedules"]["local_steps:16"]["multiplier"] = 1.1
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(step_multipliers, "TABLE_PATH", path)


@pytest.fixture
def local_steps_registered(tmp_path, monkeypatch):
    _package_table(tmp_path, monkeypatch)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


def _train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        opt.zero_grad()
        model(torch.randn(8, 64, generator=g)).square().mean().backward()
        opt.step()


def test_the_wrapper_takes_local_steps_logs_the_prices_and_checkpoints_them(
    local_steps_registered, caplog
):
    comm = commopt.create_communicator("local")

    def build(model):
        return commopt.create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            comm,
            model=model,
            compression="auto",
            auto_link_rate="100kbit",
            auto_measure_steps=1,
            sync_every=16,
        )

    model = _model()
    opt = build(model)
    with caplog.at_level(logging.INFO, logger="commopt"):
        _train(model, opt, range(3))
    chosen = opt.auto_plan
    assert chosen is not None and chosen.schedule == "local_steps", chosen
    assert chosen.inputs["local_steps"] == 16.0
    assert any(key.endswith("schedule=local_steps") for key in opt.plans), list(opt.plans)
    logged = [
        r.getMessage() for r in caplog.records if "compression='auto' chose" in r.getMessage()
    ]
    assert len(logged) == 1 and "local_steps" in logged[0] and "step multipliers" in logged[0]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    assert json.loads(opt.state_dict()["commopt"]["auto_plan"])["expected_s"]["local_steps"] > 0
    model2 = _model()
    opt2 = build(model2)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    assert opt2.auto_plan == chosen
    assert any(key.endswith("schedule=local_steps") for key in opt2.plans), list(opt2.plans)


def test_the_wrapper_takes_local_steps_with_compressed_outer_gradients(tmp_path, monkeypatch):
    _package_table(tmp_path, monkeypatch, cheap=("qsgd4+ef",))

    auto = dict(compression="auto", auto_link_rate="100kbit", auto_measure_steps=1)

    def build(model, **options):
        return commopt.create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            commopt.create_communicator("local"),
            model=model,
            sync_every=16,
            **options,
        )

    model = _model()
    opt = build(model, **auto)
    _train(model, opt, range(20))  # past the first synchronisation
    chosen = opt.auto_plan
    assert chosen is not None and chosen.schedule == "local_steps", chosen
    assert chosen.choices["0.weight"] == "qsgd4+ef", chosen.choices
    # the codec on exactly the tensors the policy compresses: one part, as compression= gives
    assert list(opt.plans) == ["compression=qsgd4+ef, schedule=local_steps"], list(opt.plans)
    with opt.true_weights():
        assert all(torch.isfinite(p).all() for p in model.parameters())
    # resumed from its state dicts, the run goes on bit for bit under the same one part
    saved = {"model": model.state_dict(), "opt": opt.state_dict()}
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    model2 = _model()
    opt2 = build(model2, **auto)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["opt"])
    assert list(opt2.plans) == list(opt.plans)
    _train(model, opt, range(20, 40))
    _train(model2, opt2, range(20, 40))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    opt.close()
    opt2.close()
    # and on one rank the run is the wrapper's with that plan from the start, bit for bit
    # (the measured step is the cycle's first inner step)
    fixed_model = _model()
    fixed = build(fixed_model, compression="qsgd4+ef", schedule="local_steps")
    _train(fixed_model, fixed, range(40))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fixed_model.parameters()))
    fixed.close()
