"""Time to accuracy's pure parts: the target from DDP fp32's curve, reaching it, the table, the plot."""

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
