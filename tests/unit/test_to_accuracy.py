"""Time to accuracy's pure parts: the target from DDP fp32's curve, reaching it, the table, the plot."""

import itertools
import json

import pytest

from commopt.bench.to_accuracy_report import markdown, plot, reached, summarize


def _report():
    return {
        "command": "commopt bench to_accuracy --budget 20",
        "link": "emulated 1gbit",
        "rate_bits": 1e9,
        "nprocs": 2,
        "machine": "test",
        "load_average_start": 1.0,
        "date": "today",
        "budget": 20,
        "eval_every": 10,
        "model": "wide char MLP",
        "runs": {
            "ddp-fp32": {
                "curve": [(0, 0.0, 4.6), (10, 8.0, 3.0), (20, 16.0, 2.8)],
                "step_times": [0.8] * 20,
                "wire_bytes": 100_000_000,
            },
            "commopt-qsgd4+ef-db": {
                "curve": [(0, 0.0, 4.6), (10, 2.0, 2.75), (20, 4.0, 2.5)],
                "step_times": [0.2] * 20,
                "wire_bytes": 12_500_000,
            },
            "ddp-powersgd1": {
                "curve": [(0, 0.0, 4.6), (10, 1.0, 3.2), (20, 2.0, 2.9)],
                "step_times": [0.1] * 20,
                "wire_bytes": 1_000_000,
            },
            "commopt-fp16": {"error": "exit code 1: boom"},
        },
    }


def test_reached_is_the_first_point_at_or_below_the_target():
    curve = [(0, 0.0, 4.0), (5, 1.0, 3.0), (10, 2.0, 2.9), (15, 3.0, 3.1)]
    assert reached(curve, 3.0) == (5, 1.0)
    assert reached(curve, 2.9) == (10, 2.0)
    assert reached(curve, 2.0) is None


def test_summary_times_each_configuration_against_ddp_fp32s_final_loss():
    rows = {r["config"]: r for r in summarize(_report())}
    ref, q, p = rows["ddp-fp32"], rows["commopt-qsgd4+ef-db"], rows["ddp-powersgd1"]
    assert ref["target"] == 2.8 and ref["reached"] and ref["wall_to_target_s"] == 16.0
    assert q["steps_to_target"] == 10 and q["wall_to_target_s"] == 2.0
    assert q["speedup_vs_ddp_fp32"] == pytest.approx(8.0)
    assert not p["reached"] and p["wall_to_target_s"] is None and p["final_loss"] == 2.9
    assert ref["link_limit_step_s"] == pytest.approx(0.8)  # 2(n-1)/n x 100 MB at 1 Gbit/s
    assert rows["commopt-fp16"]["error"] == "exit code 1: boom"


def test_tolerance_raises_the_target():
    report = dict(_report(), tolerance=0.05)  # 2.8 x 1.05 = 2.94: PowerSGD's 2.9 now counts
    rows = {r["config"]: r for r in summarize(report)}
    assert rows["ddp-fp32"]["target"] == pytest.approx(2.94)
    assert rows["ddp-powersgd1"]["reached"] and rows["ddp-powersgd1"]["wall_to_target_s"] == 2.0
    assert rows["ddp-fp32"]["steps_to_target"] == 20


def test_summary_needs_the_reference():
    report = _report()
    del report["runs"]["ddp-fp32"]
    with pytest.raises(ValueError, match="ddp-fp32"):
        summarize(report)


def test_markdown_and_plot_come_from_the_report(tmp_path):
    report = _report()
    text = markdown(report, summarize(report))
    assert "commopt bench to_accuracy --budget 20" in text
    assert "| commopt qsgd4+EF, double buffering | yes | 2.0 | 10 | 8.00 | 2.5000 |" in text
    assert "| DDP PowerSGD rank 1 | no | - | - |" in text
    assert "failed: exit code 1: boom" in text
    plot(report, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


# Several seeds, early stops, the floor, the best hook and the headline.


def _steps_of(curve):
    """Step times that add up to ``curve``'s wall times: each interval's steps alike."""
    times = []
    for (s0, w0, _), (s1, w1, _) in itertools.pairwise(curve):
        times += [(w1 - w0) / (s1 - s0)] * (s1 - s0)
    return times


def _rec(curve, compute=0.1, codec=0.0, stopped="budget", stop_target=None, wire=1_000_000):
    return {
        "curve": curve,
        "step_times": _steps_of(curve),
        "compute_s": compute,
        "codec_s": codec,
        "stopped": stopped,
        "stop_target": stop_target,
        "wire_bytes": wire,
    }


def _seeded():
    """3 seeds; fp32's final losses 2.0, 2.2, 2.1 are the seeds' targets (tolerance 0)."""
    fp32 = {
        "0": _rec([(0, 0.0, 4.0), (10, 10.0, 2.5), (20, 20.0, 2.0)], compute=0.2),
        "1": _rec([(0, 0.0, 4.0), (10, 12.0, 2.6), (20, 24.0, 2.2)], compute=0.2),
        "2": _rec([(0, 0.0, 4.0), (10, 11.0, 2.4), (20, 22.0, 2.1)], compute=0.2),
    }
    qsgd = {  # reaches every seed's target: at 10, 10 and 20 steps
        "0": _rec([(0, 0.0, 4.0), (10, 2.0, 1.9)], 0.15, 0.05, "target", 2.0),
        "1": _rec([(0, 0.0, 4.0), (10, 3.0, 2.2)], 0.15, 0.05, "target", 2.2),
        "2": _rec([(0, 0.0, 4.0), (10, 2.0, 2.3), (20, 4.0, 2.0)], 0.15, 0.05, "target", 2.1),
    }
    fp16 = {  # every seed, 2x sooner than fp32
        s: _rec(
            [(p[0], p[1] / 2, p[2]) for p in r["curve"]], 0.2, 0.01, "target", r["curve"][-1][2]
        )
        for s, r in fp32.items()
    }
    psgd = {  # fastest hook on two seeds, but seed 1 never gets there in its 40 steps
        "0": _rec([(0, 0.0, 4.0), (10, 1.0, 1.5)], stopped="target", stop_target=2.0),
        "1": _rec([(0, 0.0, 4.0), (20, 2.0, 2.5), (40, 4.0, 2.3)]),
        "2": _rec([(0, 0.0, 4.0), (10, 1.0, 2.0)], stopped="target", stop_target=2.1),
    }
    return {
        "command": "commopt bench to_accuracy --seeds 0,1,2",
        "link": "emulated 1gbit",
        "rate_bits": 1e9,
        "nprocs": 2,
        "machine": "test",
        "load_average_start": 1.0,
        "date": "today",
        "task": "text",
        "seeds": [0, 1, 2],
        "budget": 20,
        "budget_factor": 2.0,
        "powersgd_warmup": 0.1,
        "tolerance": 0.0,
        "eval_every": 10,
        "model": "wide char MLP",
        "runs": {
            "ddp-fp32": {"seeds": fp32},
            "ddp-fp16": {"seeds": fp16},
            "ddp-powersgd1-warm": {"seeds": psgd},
            "commopt-qsgd4+ef": {"seeds": qsgd},
            "commopt-auto": {
                "seeds": {s: {"error": "ValueError: unknown codec 'auto'"} for s in "012"}
            },
        },
    }


def test_each_seed_has_its_own_target_from_its_own_fp32_run():
    from commopt.bench.to_accuracy_report import targets

    assert targets(_seeded()) == {"0": 2.0, "1": 2.2, "2": 2.1}
    assert targets(dict(_seeded(), tolerance=0.1))["1"] == pytest.approx(2.42)


def test_seeds_are_aggregated_as_mean_and_sample_spread():
    rows = {r["config"]: r for r in summarize(_seeded())}
    q = rows["commopt-qsgd4+ef"]
    assert q["reached"] and q["seeds_reached"] == 3 and q["seeds_run"] == 3
    assert q["wall_to_target_s"] == pytest.approx(3.0)  # 2, 3, 4
    assert q["wall_to_target_sd"] == pytest.approx(1.0)
    assert q["steps_to_target"] == pytest.approx(40 / 3)  # 10, 10, 20
    ref = rows["ddp-fp32"]
    assert ref["wall_to_target_s"] == pytest.approx(22.0) and ref["steps_to_target"] == 20
    assert q["speedup_vs_ddp_fp32"] == pytest.approx(22.0 / 3.0)  # ratio of the means
    assert q["final_loss"] == pytest.approx((1.9 + 2.2 + 2.0) / 3)


def test_a_configuration_missing_one_seed_gets_no_speedup_and_is_not_the_best_hook():
    rows = {r["config"]: r for r in summarize(_seeded())}
    p = rows["ddp-powersgd1-warm"]
    assert not p["reached"] and p["seeds_reached"] == 2
    assert p["wall_to_target_s"] == pytest.approx(1.0)  # the mean of the seeds that reached
    assert "speedup_vs_ddp_fp32" not in p and "speedup_vs_best_hook" not in p
    # the best hook is fp16 (11 s), the fastest that reached on every seed
    assert rows["commopt-qsgd4+ef"]["speedup_vs_best_hook"] == pytest.approx(11.0 / 3.0)
    assert rows["ddp-fp16"]["speedup_vs_best_hook"] == pytest.approx(1.0)


def test_floor_is_steps_to_target_times_compute_plus_codec():
    rows = {r["config"]: r for r in summarize(_seeded())}
    q = rows["commopt-qsgd4+ef"]
    # per seed: steps x (0.15 + 0.05) = 2, 2, 4 s; walls 2, 3, 4 s: ratios 1, 1.5, 1
    assert q["floor_s"] == pytest.approx(8 / 3)
    assert q["floor_ratio"] == pytest.approx((1 + 1.5 + 1) / 3)
    assert q["seeds"]["1"]["floor_ratio"] == pytest.approx(1.5)
    assert rows["ddp-fp32"]["floor_s"] == pytest.approx(20 * 0.2)


def test_a_stricter_target_on_a_run_stopped_early_is_undecided():
    report = _seeded()
    report["tolerance"] = -0.06  # below 1.9: qsgd4's stopped curves cannot tell
    rows = {r["config"]: r for r in summarize(report)}
    assert rows["commopt-qsgd4+ef"]["undecided"] and not rows["commopt-qsgd4+ef"]["reached"]
    assert not rows["ddp-fp32"]["undecided"]


def test_headline_checks_the_goals_and_names_what_failed():
    from commopt.bench.to_accuracy_report import headline

    rows = summarize(_seeded())
    h = headline(rows)
    assert h["config"] == "commopt-qsgd4+ef" and h["best_hook"] == "ddp-fp16"
    assert h["met_vs_ddp_fp32"] and h["met_vs_best_hook"]  # 7.3x and 3.7x
    assert h["floor_ratio"] == pytest.approx(7 / 6) and h["met_floor"]  # at most 1.3x
    assert h["auto"]["config"] is None and not h["auto"]["met"]
    text = markdown(_seeded(), rows)
    assert "| commopt qsgd4+EF, overlap | 3/3 | 3.0 ± 1.0 | 13.3 ± 5.8 | 7.33 |" in text
    assert "| DDP PowerSGD rank 1, warm-up | 2/3 |" in text
    assert "failed: ValueError: unknown codec 'auto'" in text
    assert "Headline (3 seeds): commopt qsgd4+EF, overlap" in text
    assert "auto: no commopt-auto configuration reached" in text


def test_a_floor_ratio_over_the_goal_is_not_met():
    from commopt.bench.to_accuracy_report import headline

    report = _seeded()
    for rec in report["runs"]["commopt-qsgd4+ef"]["seeds"].values():
        rec["compute_s"], rec["codec_s"] = 0.05, 0.05  # the floor halves: 2.33x
    h = headline(summarize(report))
    assert h["floor_ratio"] == pytest.approx(7 / 3) and not h["met_floor"]
    assert "its floor (goal at most 1.3x: NOT met)" in markdown(report, summarize(report))


def test_auto_is_compared_with_the_best_other_configuration():
    from commopt.bench.to_accuracy_report import headline

    report = _seeded()
    auto = report["runs"]["commopt-qsgd4+ef"]["seeds"]
    report["runs"]["commopt-auto"] = {
        "seeds": {
            s: dict(r, step_times=[t * 1.04 for t in r["step_times"]]) for s, r in auto.items()
        }
    }
    h = headline(summarize(report))
    assert h["auto"]["behind"] == pytest.approx(0.04) and h["auto"]["met"]
    assert h["auto"]["best_other"] == "commopt-qsgd4+ef"


def test_plot_draws_every_seed(tmp_path):
    plot(_seeded(), str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_old_reports_without_seeds_read_as_one_seed():
    from commopt.bench.to_accuracy_report import seed_runs

    runs = seed_runs(_report())
    assert list(runs["ddp-fp32"]) == ["0"] and "curve" in runs["ddp-fp32"]["0"]


def test_the_tasks_are_real_offline_data_and_wide_models():
    import argparse

    import torch

    from commopt.bench.to_accuracy_tasks import TASKS, digits_split
    from recipes.digits_parity import load_digits_split

    ours, theirs = digits_split(), load_digits_split()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))  # the recipe's split
    args = argparse.Namespace(hidden=4096, batch=8, context=16, valid_windows=16)
    for name, low, high in (("digits", 17e6, 17.2e6), ("text", 21e6, 22e6)):
        task = TASKS[name](args)
        model = task.build()
        assert low < sum(p.numel() for p in model.parameters()) < high, name
        x, y = task.batch(torch.Generator().manual_seed(0))
        assert model(x).shape == (8, model(x).shape[1]) and y.shape == (8,), name
        x2, _ = task.batch(torch.Generator().manual_seed(0))
        assert torch.equal(x, x2), name  # batches follow the generator
        vx, vy = task.valid
        assert len(vx) == len(vy) > 0, name


def test_reports_of_separate_commands_merge_and_compare_on_common_seeds():
    """Every configuration on seed 0 by one command, the headline's on seeds 1 and 2 by
    another: one table; a one-seed configuration is compared on its seed only, and the
    headline is chosen among the configurations run on every seed."""
    from commopt.bench.to_accuracy_report import headline, merge_reports

    full = _seeded()
    first = dict(full, seeds=[0], command="first", date="monday")
    first["runs"] = {n: {"seeds": {"0": r["seeds"]["0"]}} for n, r in full["runs"].items()}
    second = dict(full, seeds=[1, 2], command="second", date="tuesday")
    second["runs"] = {
        n: {"seeds": {s: full["runs"][n]["seeds"][s] for s in "12"}}
        for n in ("ddp-fp32", "ddp-fp16", "commopt-qsgd4+ef")
    }
    merged = merge_reports([first, second])
    assert merged["seeds"] == [0, 1, 2] and merged["command"] == "first ; second"
    rows = {r["config"]: r for r in summarize(merged)}
    p = rows["ddp-powersgd1-warm"]
    assert p["reached"] and p["seeds_run"] == 1  # seed 0 only: reached there
    assert p["speedup_vs_ddp_fp32"] == pytest.approx(20.0 / 1.0)  # fp32's seed 0: 20 s
    q = rows["commopt-qsgd4+ef"]
    assert q["speedup_vs_ddp_fp32"] == pytest.approx(22.0 / 3.0)
    assert q["best_hook"] == "ddp-fp16"  # PowerSGD ran seed 0 only
    assert q["speedup_vs_best_hook"] == pytest.approx(11.0 / 3.0)
    h = headline(list(rows.values()))
    assert h["config"] == "commopt-qsgd4+ef" and h["seeds"] == 3
    assert "Headline (3 seeds)" in markdown(merged, list(rows.values()))
    again = merge_reports([second, second])  # the same runs twice: the first kept
    assert again["runs"]["ddp-fp32"]["seeds"]["1"] is second["runs"]["ddp-fp32"]["seeds"]["1"]
    other = json.loads(json.dumps(second))
    other["runs"]["ddp-fp32"]["seeds"]["1"]["curve"][-1][2] = 9.0
    with pytest.raises(ValueError, match="ddp-fp32 seed 1 is in more than one report with other"):
        merge_reports([second, other])
    with pytest.raises(ValueError, match="task differ"):
        merge_reports([first, dict(second, task="digits")])
    assert merge_reports([full]) is full


def test_a_report_read_with_a_configuration_list_keeps_those_runs_only(tmp_path):
    """``PATH#CONFIG,CONFIG``: a file's other runs merge beside a configuration that a later
    command measured again (the same configuration and seed in two files with other losses
    raise otherwise)."""
    from commopt.bench.to_accuracy_report import merge_reports, read_report

    full = json.loads(json.dumps(_seeded()))  # as read back from a file
    path = tmp_path / "r.json"
    path.write_text(json.dumps(full))
    assert read_report(str(path))["runs"].keys() == full["runs"].keys()
    part = read_report(f"{path}#ddp-fp32, ddp-fp16")
    assert list(part["runs"]) == ["ddp-fp32", "ddp-fp16"]
    assert part["runs"]["ddp-fp16"]["seeds"] == full["runs"]["ddp-fp16"]["seeds"]
    again = json.loads(json.dumps(full))
    again["runs"] = {
        n: again["runs"][n] for n in ("ddp-fp32", "commopt-qsgd4+ef")
    }  # commopt-qsgd4+ef "re-measured": other losses
    again["runs"]["commopt-qsgd4+ef"]["seeds"]["0"]["curve"][-1][2] = 0.5
    with pytest.raises(ValueError, match="other losses"):
        merge_reports([full, again])
    everything_else = [n for n in full["runs"] if n != "commopt-qsgd4+ef"]
    merged = merge_reports([read_report(f"{path}#{','.join(everything_else)}"), again])
    assert merged["runs"]["commopt-qsgd4+ef"]["seeds"]["0"]["curve"][-1][2] == 0.5
    with pytest.raises(ValueError, match="has no runs of"):
        read_report(f"{path}#commopt-nope")


# The settings: DDP fp32's step against its compute-only step, checked; the charts.


def _fp32_only(step_s, compute_s, setting="link-bound"):
    report = _seeded()
    report["setting"] = setting
    for rec in report["runs"]["ddp-fp32"]["seeds"].values():
        rec["step_times"] = [step_s] * len(rec["step_times"])
        rec["compute_s"] = compute_s
    return report


def test_a_link_bound_run_below_8x_is_flagged_loudly(capsys):
    from commopt.bench.to_accuracy_report import setting_check, write_outputs

    check = setting_check(_fp32_only(1.0, 0.2))  # 5x
    assert check["ratio"] == pytest.approx(5.0) and check["met"] is False
    assert check["text"].startswith("WARNING: NOT LINK-BOUND") and "8x" in check["text"]
    report = _fp32_only(1.0, 0.2)
    write_outputs(report, type("A", (), {"tolerance": 0.0})())
    out = capsys.readouterr()
    assert "WARNING: NOT LINK-BOUND" in out.err and "WARNING: NOT LINK-BOUND" in out.out
    assert report["setting_check"]["met"] is False


def test_a_link_bound_run_at_8x_or_more_holds_and_compute_heavy_promises_nothing():
    from commopt.bench.to_accuracy_report import setting_check

    check = setting_check(_fp32_only(2.0, 0.25))  # exactly 8x
    assert check["met"] is True and "holds" in check["text"]
    heavy = setting_check(_fp32_only(1.0, 0.4, "compute-heavy"))
    assert heavy["met"] is None and heavy["ratio"] == pytest.approx(2.5)
    assert "WARNING" not in heavy["text"]
    assert "2.5x its compute-only step" in markdown(_fp32_only(1.0, 0.4, "compute-heavy"), [])


def test_the_settings_fill_only_what_the_command_left_unset():
    import argparse

    from commopt.bench.to_accuracy import DEFAULT_CONFIGS, LINK_BOUND_CONFIGS, apply_setting

    unset = dict(batch=None, hidden=None, link=None, configs=None, outer_lr=None)
    args = apply_setting(argparse.Namespace(setting="link-bound", **unset))
    assert (args.batch, args.hidden, args.link, args.outer_lr, args.configs) == (
        16,
        2048,
        "100mbit",
        0.35,
        LINK_BOUND_CONFIGS,
    )
    assert (
        apply_setting(
            argparse.Namespace(setting="link-bound", **{**unset, "outer_lr": 0.7})
        ).outer_lr
        == 0.7
    )
    args = apply_setting(argparse.Namespace(setting="compute-heavy", **{**unset, "batch": 8}))
    assert (args.batch, args.hidden, args.link, args.outer_lr, args.configs) == (
        8,
        4096,
        "1gbit",
        None,
        DEFAULT_CONFIGS,
    )


def test_a_disturbed_block_of_steps_does_not_move_the_time_to_the_target():
    from commopt.bench.to_accuracy_report import step_repeats

    report = _seeded()
    rec = report["runs"]["ddp-fp32"]["seeds"]["0"]
    rec["step_times"] = rec["step_times"][:14] + [5.0] * 6  # the last third 5x slower
    row = {r["config"]: r for r in summarize(report)}["ddp-fp32"]
    seed0 = row["seeds"]["0"]
    assert seed0["wall_to_target_s"] == pytest.approx(20.0)  # 20 steps x 1.0 s
    assert seed0["measured_wall_s"] == 20.0  # the curve's (synthetic) wall time
    assert row["outlier_repeats"] and "seed 0: repeat 3 of 3" in row["outlier_repeats"][0]
    # PowerSGD's warm-up steps are priced at their own median.
    assert step_repeats([2.0] * 4 + [0.5] * 12, 16, skip=4)["time_s"] == pytest.approx(14.0)


def test_an_outlier_repeat_of_the_compute_only_twin_is_reported():
    report = _seeded()
    rec = report["runs"]["ddp-fp32"]["seeds"]["0"]
    rec["compute_s"], rec["compute_repeats"] = 0.1, [0.1, 0.1, 0.2]
    rows = summarize(report)
    row = {r["config"]: r for r in rows}["ddp-fp32"]
    assert row["outlier_compute"] == [
        "seed 0: repeat 3 of 3 200.0 ms/step against their median 100.0 ms"
    ]
    assert "outlier repeat of the compute-only twin (kept in the median): seed 0: repeat 3" in (
        markdown(report, rows)
    )


def test_charts_are_drawn_from_result_files(tmp_path):
    pytest.importorskip("matplotlib")
    from commopt.bench.to_accuracy_charts import group_reports, speedups, write_charts

    paths = []
    for task, setting in (("text", "link-bound"), ("digits", "link-bound"), ("text", None)):
        report = dict(_seeded(), task=task, setting=setting)
        path = tmp_path / f"{task}-{setting}.json"
        path.write_text(json.dumps(report))
        paths.append(str(path))
    groups = group_reports([json.loads(open(p).read()) for p in paths])
    assert list(groups) == [
        ("text", "link-bound"),
        ("digits", "link-bound"),
        ("text", "compute-heavy"),
    ]
    bars = {label: (value, why) for label, value, why in speedups(groups[("text", "link-bound")])}
    assert "DDP fp32" not in bars and bars["commopt qsgd4+EF, overlap"][0] > 1
    assert bars["commopt auto, overlap"] == (None, "failed")
    assert bars["DDP PowerSGD rank 1, warm-up"] == (None, "did not reach the target")
    written = write_charts(paths, tmp_path / "charts")
    names = sorted(p.name for p in written)
    assert names == [
        "tta-digits-link-bound.png",
        "tta-speedup.png",
        "tta-text-compute-heavy.png",
        "tta-text-link-bound.png",
    ]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
