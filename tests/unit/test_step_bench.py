"""The step benchmark's arithmetic and tables (commopt.bench.step), in one process."""

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commopt.bench.step import cli, configs, driver, figures, models
from commopt.bench.step import report as rp

REPO = Path(__file__).resolve().parents[2]


def test_allreduce_limit_is_two_n_minus_one_over_n_bytes_over_rate():
    mb100 = 100e6
    assert configs.allreduce_limit_s(mb100, 2, 1e9) == pytest.approx(
        0.8
    )  # 2*(1/2)*800 Mbit / 1 Gbit/s
    assert configs.allreduce_limit_s(mb100, 4, 1e9) == pytest.approx(1.2)  # 2*(3/4)
    assert configs.allreduce_limit_s(mb100, 1, 1e9) == 0.0
    assert configs.allreduce_limit_s(mb100, 2, None) is None  # loopback: no limit
    assert configs.allreduce_limit_s(mb100, 2, configs.parse_rate("100mbit")) == pytest.approx(8.0)


def test_parse_rate_reads_tc_units_and_refuses_nonsense():
    assert configs.parse_rate("1gbit") == 1e9
    assert configs.parse_rate("100mbit") == 1e8
    assert configs.parse_rate("2.5Gbit") == 2.5e9
    with pytest.raises(ValueError, match="1gbit"):
        configs.parse_rate("fast")


@pytest.mark.parametrize(
    "shape", [(4096, 1024), (1024, 4096), (16, 1024), (3, 3), (64, 3, 3, 3), (10, 128), (1024,)]
)
@pytest.mark.parametrize("rank", [1, 4])
def test_powersgd_bytes_follow_torchs_compression_rule(shape, rank):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    numel = math.prod(shape)
    expected = numel
    if len(shape) > 1:
        compress, _, compressed = _should_compress(shape[0], numel // shape[0], rank, 2)
        expected = compressed if compress else numel
    assert configs.powersgd_wire_bytes([shape], rank) == 4 * expected


def test_ddp_wire_bytes_of_each_hook():
    shapes = [(4096, 1024), (4096,)]
    numel = 4096 * 1024 + 4096
    assert configs.ddp_wire_bytes(configs.CONFIGS["ddp-fp32"], shapes) == 4 * numel
    assert configs.ddp_wire_bytes(configs.CONFIGS["ddp-fp16"], shapes) == 2 * numel
    assert configs.ddp_wire_bytes(configs.CONFIGS["ddp-bf16"], shapes) == 2 * numel
    assert "ddp-bf16" not in configs.STEP_DEFAULT_CONFIGS  # torch refuses it without NCCL/XPU
    assert configs.ddp_wire_bytes(configs.CONFIGS["ddp-powersgd1"], shapes) == 4 * (
        (4096 + 1024) + 4096
    )


def test_efficiency_is_throughput_ratio_over_n():
    # e = t / (t0 n): 2 ranks of batch 8 at 0.5 s/step vs 1 rank of batch 8 at 0.4 s/step.
    t, t0, n = 2 * 8 / 0.5, 8 / 0.4, 2
    assert figures.efficiency(0.5, 0.4) == pytest.approx(t / (t0 * n)) == pytest.approx(0.8)


def test_comm_wait_share_never_negative():
    assert figures.comm_wait_share(1.0, 0.25) == pytest.approx(0.75)
    assert figures.comm_wait_share(0.2, 0.25) == 0.0  # faster than the 1-rank run: no wait


def _result(step, size=2, batch=8, loss=1.0, wire=1000, compute=None):
    """A merged result of 3 rounds whose medians are step * (0.8, 1, 1.3)."""
    rounds = [
        {
            "step_times": [s * 1.1, s, s * 0.9],
            "compute_times": [compute or step] * 2,
            "backward_times": [s / 2] * 3,
            "cpu_per_step": [s * 0.9] * 2,
            "eval_loss": loss,
        }
        for s in (step * 0.8, step, step * 1.3)
    ]
    return {"rounds": rounds, "size": size, "batch": batch, "wire_bytes": wire, "ranks_agree": True}


def md_cells(line: str) -> list[str]:
    """The cells of one markdown table line, without their padding."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_robust_step_is_the_median_of_round_medians():
    rounds = [
        {"step_times": [1.0, 9.0, 2.0]},
        {"step_times": [3.0]},
        {"step_times": [50.0, 60.0, 70.0]},
    ]
    assert figures.robust_step(rounds) == 3.0  # medians 2, 3, 60
    assert figures.robust_step([]) is None


def test_merge_rounds_groups_by_round_and_checks_the_ranks_agree():
    def rec(round_, rank, checksum, kind="commopt"):
        return {
            "config": "c",
            "kind": kind,
            "round": round_,
            "rank": rank,
            "size": 2,
            "batch": 8,
            "step_times": [0.1 * (round_ + 1) + 0.01 * rank],
            "backward_times": [0.05],
            "compute_times": [0.04, 0.06],
            "losses": [2.0],
            "eval_loss": 1.5 + round_,
            "checksum": checksum,
            "wire_bytes": 10,
            "params": 5,
        }

    merged = figures.merge_rounds([rec(0, 0, 1.0), rec(0, 1, 1.0), rec(1, 1, 2.0), rec(1, 0, 2.0)])
    assert [r["step_times"] for r in merged["rounds"]] == [[0.1], [0.2]]  # rank 0's, by round
    assert merged["rounds"][1]["rank_step_medians"] == pytest.approx([0.2, 0.21])
    assert merged["ranks_agree"] is True and merged["wire_bytes"] == 10
    assert merged["rounds"][0]["compute_times"] == [0.04, 0.06]
    assert figures.merge_rounds([rec(0, 0, 1.0), rec(0, 1, 1.5)])["ranks_agree"] is False


def test_summarize_derives_every_column_side_by_side():
    results = {
        "ddp-fp32": _result(1.0, wire=100_000_000, compute=0.1),
        "commopt-qsgd4-db": _result(0.2, wire=13_000_000, compute=0.1),
        "ddp-fp16": {"error": "exit code 1; log x\nboom"},
    }
    rows = {r.config: r for r in figures.summarize(results, n=2, rate_bits=1e9)}
    q = rows["commopt-qsgd4-db"]
    assert q.step_s == pytest.approx(0.2)  # the median of round medians
    assert q.compute_s == pytest.approx(0.1)
    assert q.samples_per_s == pytest.approx(2 * 8 / 0.2)
    assert q.speedup == pytest.approx(5.0)
    assert q.efficiency == pytest.approx(0.5)  # its own compute time / its step
    assert q.comm_wait == pytest.approx(0.5)
    assert q.limit_s == pytest.approx(0.104)
    assert rows["ddp-fp32"].speedup == pytest.approx(1.0)
    assert rows["ddp-fp32"].limit_s == pytest.approx(0.8)
    assert rows["ddp-fp32"].efficiency == pytest.approx(0.1)
    assert rows["ddp-fp16"].error.startswith("exit code 1") and rows["ddp-fp16"].step_s is None


def test_efficiency_pairs_each_block_with_the_compute_steps_beside_it():
    r = _result(0.5, compute=0.1)  # by medians alone: 0.1 / 0.5 = 20%
    for rnd, effs in zip(r["rounds"], ([0.5, 0.7], [0.6], [0.9, 0.4])):
        rnd["block_efficiency"] = effs
    row = figures.summarize({"commopt-fp32": r}, n=2, rate_bits=None)[0]
    assert row.efficiency == pytest.approx(0.6)  # median of 0.5, 0.7, 0.6, 0.9, 0.4
    assert row.comm_wait == pytest.approx(0.4)


def test_summarize_without_baseline_or_link_leaves_those_columns_empty():
    rows = figures.summarize({"commopt-fp16": _result(0.3, compute=0.15)}, n=2, rate_bits=None)
    assert rows[0].speedup is None and rows[0].limit_s is None
    assert rows[0].efficiency == pytest.approx(0.5)


def test_targets_say_met_or_not():
    results = {
        "ddp-fp32": _result(1.0),
        "ddp-powersgd1": _result(0.3),
        "commopt-qsgd4": _result(0.2),
    }
    lines = figures.check_targets("communication", figures.summarize(results, 2, 1e9))
    assert "5.00x faster per step than DDP fp32 (target >= 5x: met)" in lines[0]
    assert "1.50x faster than the best DDP hook (ddp-powersgd1" in lines[1] and "met" in lines[1]
    results["ddp-powersgd1"] = _result(0.25)
    lines = figures.check_targets("communication", figures.summarize(results, 2, 1e9))
    assert "NOT met" in lines[1]
    lines = figures.check_targets(
        "compute",
        figures.summarize(
            {
                "commopt-fp32": _result(0.105, compute=0.1),
                "commopt-fp32-db": _result(0.2, compute=0.1),
            },
            2,
            1e9,
        ),
    )
    assert "95%" in lines[0] and "commopt-fp32)" in lines[0] and "(target >= 90%: met)" in lines[0]
    lines = figures.check_targets(
        "compute", figures.summarize({"commopt-fp32": _result(0.2, compute=0.1)}, 2, 1e9)
    )
    assert "50%" in lines[0] and "NOT met" in lines[0]


def test_tables_have_one_line_per_configuration():
    results = {
        "ddp-fp32": _result(1.0, wire=100_000_000, compute=0.1),
        "commopt-qsgd4": {"error": "exit code 1 (log x):\n[rank1]: RuntimeError: boom"},
    }
    rows = figures.summarize(results, 2, 1e9)
    text = rp.format_table(rows).splitlines()
    assert len(text) == 2 + 2 and text[0].startswith("configuration")
    assert "failed: RuntimeError: boom" in text[-1]
    md = rp.markdown_table(rows).splitlines()
    assert len(md) == 2 + 2 and all(line.count("|") == len(rp.TABLE_COLUMNS) + 1 for line in md)
    # no codec time recorded (a report from before the floor): codec, floor and ratio empty
    assert md_cells(md[2]) == [
        "ddp-fp32",
        "1000 (800-1300)",
        "100",
        "900",
        "800",
        "-",
        "-",
        "-",
        "link",
        "16.0",
        "1.00x",
        "10%",
        "90%",
        "1.0000",
    ]
    assert md_cells(md[3])[:2] == ["commopt-qsgd4", "failed: RuntimeError: boom"]


def test_reports_from_before_the_cpu_column_still_render():
    old = _result(1.0, wire=100_000_000, compute=0.1)
    for rd in old["rounds"]:
        del rd["cpu_per_step"]
    row = figures.summarize({"ddp-fp32": old}, 2, 1e9)[0]
    assert row.cpu_s is None and rp.table_cells(row)[3] == "-"


def test_configs_cover_the_issue():
    names = set(configs.CONFIGS)
    assert {"ddp-fp32", "ddp-fp16", "ddp-powersgd1", "ddp-powersgd4"} <= names
    for wire in ("fp32", "fp16", "qsgd4", "qsgd4+ef"):
        assert f"commopt-{wire}" in names and f"commopt-{wire}-db" in names
    assert set(configs.DEMO_CONFIGS) <= names


def test_models_sizes_and_data_are_deterministic():
    torch.manual_seed(0)
    mlp = models.MODELS["mlp"].build()
    n = sum(p.numel() for p in mlp.parameters())
    assert 24e6 < n < 26e6
    cnn = models.MODELS["cnn"].build()
    assert sum(p.numel() for p in cnn.parameters()) < 1e6
    spec = models.MODELS["tiny"]
    x0, _y0 = spec.batch(step=3, rank=0, size=4)
    x0b, _ = spec.batch(step=3, rank=0, size=4)
    x1, _ = spec.batch(step=3, rank=1, size=4)
    assert torch.equal(x0, x0b) and not torch.equal(x0, x1)
    ex, ey = spec.eval_batch(8)
    assert ex.shape == (8, 32) and ey.shape == (8,)


def test_plan_link_without_link_is_loopback_and_says_so():
    plan = driver.plan_link(None)
    assert plan.rate_bits is None and plan.link_arg is None and "loopback" in plan.description


def _report(command: str, load_end: float, mlp: dict, role: str | None = None, **link) -> dict:
    """A saved report of one model, a wide MLP on 2 ranks joined by an emulated 1 Gbit/s link."""
    return {
        "command": command,
        "link": "emulated 1gbit",
        **link,
        "nprocs": 2,
        "threads_per_rank": 1,
        "machine": "cpu",
        "torch": "x",
        "load_average_start": 1.0,
        "load_average_end": load_end,
        "date": "today",
        "warmup": 3,
        "rounds": 3,
        "models": {
            "mlp": {
                "description": "wide MLP",
                **({"role": role} if role else {}),
                "params": 25_000_000,
                "batch_per_rank": 8,
                "steps": 5,
                "fp32_allreduce_limit_s": 0.8,
                **mlp,
            }
        },
    }


def test_markdown_report_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    results = {"ddp-fp32": _result(1.0, compute=0.4), "commopt-fp16-db": _result(0.5, compute=0.4)}
    rows = figures.summarize(results, 2, 1e9)
    report = _report(
        "commopt bench step --models mlp",
        2.0,
        {"rows": [vars(r) for r in rows], "targets": figures.check_targets("communication", rows)},
    )
    md = rp.markdown_report(json.loads(json.dumps(report)))
    assert "Command: `commopt bench step --models mlp`" in md and "needs 800 ms" in md
    assert "3 round(s), each 3 warm-up and 5 timed steps" in md
    png = tmp_path / "steps.png"
    rp.plot_step_times(report, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--configs", "ddp-fp64", "--no-link"],
            "unknown configuration ddp-fp64; choose from ddp-fp32",
        ),
        (
            ["--models", "mlp", "--link", "fast"],
            "cannot read the link rate 'fast': write it as tc does, e.g. 1gbit",
        ),
        (["--steps", "0"], "need --steps, --block and --compute-steps >= 1"),
    ],
)
def test_command_refuses_bad_options_with_the_fix(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "commopt", "bench", "step", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert message in proc.stderr


def test_demo_summary_explains_the_result():
    from commopt.commands import demo

    rows = {
        r.config: vars(r)
        for r in figures.summarize(
            {
                "ddp-fp32": _result(1.0, wire=100_000_000, compute=0.1, loss=1.9),
                "commopt-qsgd4": _result(0.4, wire=13_000_000, compute=0.1, loss=1.9),
                "commopt-qsgd4+ef-db": _result(0.3, wire=13_000_000, compute=0.1, loss=2.0),
            },
            2,
            1e9,
        )
    }
    info = {"params": 25_000_000, "fp32_allreduce_limit_s": 0.8, "steps": 27}
    report = {
        "link": "emulated hosts joined by 1gbit links",
        "link_rate": "1gbit",
        "rate_bits": 1e9,
        "nprocs": 2,
        "load_average_start": 0.5,
    }
    text = demo._summary(rows, info, report)
    assert "commopt-qsgd4+ef-db takes 300 ms per step against DDP fp32's 1000 ms (3.3x)" in text
    assert "needs 800 ms per step on a 1gbit link" in text and "one step late" in text
    assert "share this machine's cores" in text and "busy" not in text
    assert "final loss 2.0000 against 1.9000" in text and "not compared" not in text
    # A few steps from scratch: the losses say nothing about the codecs, and the demo says so.
    short = demo._summary(rows, info, report, steps=8)
    assert "final loss 2.0000" not in short and "one step late" not in short
    assert "The final losses are not compared: 8 steps from scratch are too few" in short
    assert f"--steps {demo.LOSS_COMPARISON_MIN_STEPS} or more" in short
    loopback = dict(
        report, rate_bits=None, link_rate=None, link="plain loopback, unshaped: no root"
    )
    text = demo._summary(rows, dict(info, fp32_allreduce_limit_s=None), loopback)
    assert "Note: plain loopback, unshaped: no root. Loopback is far faster" in text


def test_demo_keeps_the_allreduce_tour_and_refuses_too_few_steps(capsys):
    import argparse

    from commopt.commands import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert parser.parse_args(["--tour"]).tour is True
    assert "needs root" in parser.format_help() and "5 minutes" in parser.format_help()
    assert demo.run(parser.parse_args(["--steps", "3"])) == 2
    assert "--steps must be at least 4" in capsys.readouterr().err


def test_from_json_recomputes_the_tables_of_a_saved_report(tmp_path, capsys):
    raw = {
        "ddp-fp32": _result(1.0, wire=100_000_000, compute=0.2),
        "commopt-qsgd4-db": _result(0.25, wire=13_000_000, compute=0.2),
    }
    report = _report(
        "commopt bench step",
        1.0,
        {"raw": raw, "rows": [], "targets": []},
        role="communication",
        link_rate="1gbit",
        rate_bits=1e9,
    )
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    md = tmp_path / "out.md"
    args = parser.parse_args(["--from-json", str(saved), "--markdown", str(md)])
    assert cli.run(args) == 0
    text = md.read_text()
    row = next(
        md_cells(line) for line in text.splitlines() if line.startswith("| commopt-qsgd4-db")
    )
    assert (
        row[:5] == ["commopt-qsgd4-db", "250 (200-325)", "200", "225", "104"]
        and row[rp.TABLE_COLUMNS.index("speed-up")] == "4.00x"
    )
    assert "target >= 5x: NOT met" in text and "commopt-qsgd4-db" in capsys.readouterr().out


def test_bench_step_is_a_real_subcommand_and_a_missing_module_is_an_error(monkeypatch):
    import argparse

    from commopt.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["step", "--configs", "ddp-fp32", "--no-link"])
    assert (
        args.bench_module is importlib.import_module("commopt.bench.step")
        and args.configs == "ddp-fp32"
    )
    # A benchmark named in the list whose module is not installed: a broken installation, said so
    # (never a quiet "not available").
    monkeypatch.setitem(bench.BENCHMARKS, "warp-drive", "a benchmark whose module is missing")
    with pytest.raises(
        ImportError, match=r"commopt.bench.warp-drive is missing from this installation"
    ):
        bench.add_arguments(argparse.ArgumentParser())


def test_floor_is_compute_plus_codec_or_the_link_and_the_ratio_is_step_over_floor():
    slow_link = _result(1.0, wire=100_000_000, compute=0.1)  # link limit 800 ms
    fast_link = _result(0.3, wire=1_000_000, compute=0.1)  # link limit 8 ms
    for res in (slow_link, fast_link):
        for rd in res["rounds"]:
            rd["codec_s"] = 0.05
    a, b = figures.summarize({"ddp-fp32": slow_link, "commopt-qsgd4": fast_link}, 2, 1e9)
    assert a.floor_s == pytest.approx(0.8) and a.floor_ratio == pytest.approx(1.25)
    assert b.floor_s == pytest.approx(0.15) and b.floor_ratio == pytest.approx(2.0)
    # the floor is the wire (800 ms) for one, compute + codec (150 ms against 8 ms) for the other
    assert a.bound == "link"
    assert b.bound == "processor" and rp.table_cells(b)[5:9] == ["50", "150", "2.00x", "processor"]


def test_codec_seconds_measures_each_kind_of_configuration():
    from commopt.bench.step import configs, floor

    shapes = [(64, 48), (64,)]
    for name in (
        "ddp-fp32",
        "ddp-fp16",
        "ddp-powersgd1",
        "commopt-fp32",
        "commopt-fp16",
        "commopt-qsgd4",
        "commopt-qsgd4+ef",
    ):
        assert 0 < floor.codec_seconds(configs.CONFIGS[name], shapes, 2, repeats=1) < 5, name


def test_merge_rounds_keeps_each_ranks_profile():
    entries = [
        {
            "config": "ddp-fp32",
            "round": 0,
            "rank": r,
            "size": 2,
            "batch": 8,
            "step_times": [1.0],
            "compute_times": [0.5],
            "checksum": 1.0,
            "wire_bytes": 4,
            "params": 1,
            "codec_s": 0.01,
            "profile": {"steps": 2, "rank": r},
        }
        for r in (0, 1)
    ]
    merged = figures.merge_rounds(entries)
    assert merged["rounds"][0]["codec_s"] == 0.01
    assert sorted(merged["profile"]) == ["0", "1"] and merged["profile"]["1"]["rank"] == 1
