"""The GPU check's plumbing, on a machine without a GPU: the stage runner and its time budget,
the rehearsal (every stage reached, the GPU ones skipped with the reason after their CPU
stand-in ran), and the report it renders (docs/benchmarks-gpu.md is that report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commopt.gpu_check import report
from commopt.gpu_check.runner import Budget, Context, Skip, Stage, run_stages
from commopt.gpu_check.stages import STAGES
from tests.unit.bench_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _quiet(msg: str) -> None:
    pass


def test_a_failing_stage_is_recorded_and_the_next_one_runs(tmp_path):
    def broken(ctx):
        raise ValueError("broken on purpose")

    def fine(ctx):
        return {"limit": ctx.limit_s}

    def elsewhere(ctx):
        raise Skip("not on this machine")

    stages = [
        Stage("a", "A", broken, 1, 0, 0, gpu=False),
        Stage("b", "B", fine, 1, 0, 0, gpu=False),
        Stage("c", "C", elsewhere, 1, 0, 0, gpu=False),
        Stage("d", "D", fine, 1, 0, 0),  # a GPU stage: its stand-in runs here
    ]
    ctx = Context(root=ROOT, work=tmp_path, rehearse=True)
    results = run_stages(stages, ctx, Budget(40.0, clock=lambda: 0.0), say=_quiet)
    assert [r["status"] for r in results] == ["failed", "passed", "skipped", "skipped"]
    assert "broken on purpose" in results[0]["reason"]
    assert "ValueError" in results[0]["traceback"]
    assert results[1]["details"] == {"limit": pytest.approx(40.0 / 3)}
    assert results[2]["reason"] == "not on this machine"
    assert "rehearsal" in results[3]["reason"] and results[3]["standin"]["status"] == "passed"


def test_a_machine_whose_gpu_torch_cannot_use_fails_its_gpu_stages(tmp_path):
    # nvidia-smi lists a GPU, torch sees none: the stand-ins run, but the GPU stages fail
    ctx = Context(root=ROOT, work=tmp_path, rehearse=False)
    ctx.env.update(nvidia_smi="GPU 0: NVIDIA H200 (UUID: GPU-0)", torch="2.11.0+cu130")
    stages = [
        Stage("k", "K", lambda ctx: {}, 1, 0, 0),
        Stage("e", "E", lambda ctx: {}, 1, 0, 0, gpu=False),
    ]
    results = run_stages(stages, ctx, Budget(40.0, clock=lambda: 0.0), say=_quiet)
    assert results[0]["status"] == "failed" and results[0]["standin"]["status"] == "passed"
    assert "nvidia-smi lists" in results[0]["reason"] and "NVIDIA H200" in results[0]["reason"]
    assert results[1]["status"] == "passed"  # not a GPU stage


def test_results_are_written_after_every_stage(tmp_path, monkeypatch):
    from commopt import gpu_check
    from commopt.gpu_check import stages as stage_module

    seen = []

    def first(ctx):
        return {"n": 1}

    def second(ctx):
        # the first stage's result is on disk before the second one starts
        seen.append(json.loads((tmp_path / "gpu-check.json").read_text()))
        return {"n": 2}

    monkeypatch.setattr(
        stage_module,
        "STAGES",
        [
            Stage("first", "F", first, 1, 0, 0, gpu=False),
            Stage("second", "S", second, 1, 0, 0, gpu=False),
        ],
    )
    args = gpu_check.parse_args(["--out", str(tmp_path), "--rehearse", "--budget-s", "30"])
    result = gpu_check.run(args, say=_quiet)
    (early,) = seen
    assert [s["name"] for s in early["stages"]] == ["first"]
    assert "stopped early? 1 of 2 stages ran" in early["verdict"]
    assert (tmp_path / "gpu-check.md").exists() and (tmp_path / "gpu-check-logs.txt").exists()
    assert [s["name"] for s in result["stages"]] == ["first", "second"]
    final = json.loads((tmp_path / "gpu-check.json").read_text())
    assert final["verdict"] == "2 passed, 0 failed, 0 skipped"


def test_a_stage_with_its_own_time_leaves_the_shared_budget_whole(tmp_path):
    now = [0.0]

    def preflight(ctx):
        now[0] += 20.0
        return {"limit": ctx.limit_s}

    def shared(ctx):
        return {"limit": ctx.limit_s}

    stages = [
        Stage("pre", "P", preflight, 0, 0, 0, gpu=False, own_s=45),
        Stage("x", "X", shared, 1, 0, 0, gpu=False),
    ]
    ctx = Context(root=ROOT, work=tmp_path, rehearse=True)
    results = run_stages(stages, ctx, Budget(30.0, clock=lambda: now[0]), say=_quiet)
    assert results[0]["details"]["limit"] == 45
    assert results[1]["details"]["limit"] == pytest.approx(30.0)  # the preflight's 20 s given back


def test_time_left_over_goes_to_later_stages_and_none_left_skips_saying_so(tmp_path):
    now = [0.0]

    def slow(ctx):
        now[0] += 40.0  # overruns its share and the budget
        return {}

    def quick(ctx):
        return {"limit": ctx.limit_s}

    stages = [
        Stage("quick", "Q", quick, 1, 0, 5, gpu=False),
        Stage("slow", "S", slow, 1, 0, 5, gpu=False),
        Stage("late", "L", quick, 1, 0, 5, gpu=False),
    ]
    ctx = Context(root=ROOT, work=tmp_path, rehearse=True)
    results = run_stages(stages, ctx, Budget(30.0, clock=lambda: now[0]), say=_quiet)
    assert results[0]["details"]["limit"] == pytest.approx(10.0)
    assert results[1]["limit_s"] == pytest.approx(15.0)  # the first one's share, unused
    assert results[2]["status"] == "skipped"
    assert results[2]["reason"].startswith("time budget: 0 s left of 30 s")
    assert "--budget-s" in results[2]["reason"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1500)
def test_the_rehearsal_reaches_every_stage_and_skips_the_gpu_ones_with_the_reason(tmp_path):
    # About 40 s of CPU time in all. The budget is a ceiling, set far above the default so
    # that a busy machine (each stage is killed at its share) slows the test, never fails it.
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPU_CHECK_PYTHON=sys.executable, OUT=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--rehearse", "--budget-s", "900"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["rehearse"] and result["counts"]["failed"] == 0
    stages = {s["name"]: s for s in result["stages"]}
    assert list(stages) == [s.name for s in STAGES]
    for stage in STAGES:
        got = stages[stage.name]
        if stage.gpu:
            assert got["status"] == "skipped" and got["reason"].startswith("rehearsal"), got
            standin = got["standin"]
            # skipped only for a package this machine lacks, saying which to install
            assert standin["status"] == "passed" or (
                standin["status"] == "skipped" and "pip install" in standin["reason"]
            ), standin
        else:
            assert got["status"] == "passed" or (got["status"] == "skipped" and got["reason"]), got
    assert stages["preflight"]["details"]["cuda"] is False
    if stages["triton_exact"]["standin"]["status"] == "passed":
        exact = stages["triton_exact"]["standin"]["details"]
        assert exact["run"] == exact["planned"] and all(c["ok"] for c in exact["cases"])
    two = stages["two_ranks"]["standin"]["details"]["runs"]["torch+gloo"]
    assert [r["rank"] for r in two["ranks"]] == [0, 1]
    loops = stages["host_syncs"]["standin"]["details"]["runs"]["torch+gloo"]["ranks"][0]["loops"]
    assert {loop["loop"].split(",")[0] for loop in loops} == {"double-buffered", "overlapped"}
    assert all(loop["finite"] for loop in loops)
    text = (tmp_path / "gpu-check.md").read_text()
    assert text == report.render(result)
    assert all(s.title in text for s in STAGES) and "rehearsal" in text.lower()
    assert "===== train" in (tmp_path / "gpu-check-logs.txt").read_text()


gpu_bench = load_benchmark("gpu_bench")
SAMPLE_SIZE = {
    "mib": 64,
    "copy_gbs": 1500.0,
    "copy_ms": 0.04,
    "timing": "median of triton.testing.do_bench",
    "rows": [
        {"codec": "qsgd4", "encode_gbs": 1200.0, "decode_gbs": 1300.0, "wire_ratio": 0.133},
        {"codec": "fp16", "encode_gbs": 900.0, "decode_gbs": 1000.0, "wire_ratio": 0.5},
    ],
}
SAMPLE_STAGES = [
    {
        "name": "throughput",
        "title": "Kernel throughput against the copy bandwidth",
        "gpu": True,
        "status": "passed",
        "wall_s": 20.0,
        "details": {
            "target": 0.7,
            "sizes": [SAMPLE_SIZE],
            "table": gpu_bench.codec_table([SAMPLE_SIZE]),
        },
    },
    {
        "name": "host_syncs",
        "title": "No host sync in the step (sync debug mode)",
        "gpu": True,
        "status": "failed",
        "wall_s": 30.0,
        "reason": "StageFailed: torch+nccl: rank 0: 2 host syncs",
        "details": {
            "runs": {
                "torch+nccl": {
                    "launcher": "torch",
                    "wall_s": 12.0,
                    "failures": ["rank 0: 2 host syncs"],
                    "ranks": [
                        {
                            "loops": [
                                {
                                    "loop": "double-buffered, None",
                                    "host_syncs_total": 2,
                                    "steps_counted": 5,
                                    "host_syncs": {"step": 2},
                                    "sync_sites": {"step: commopt/reducer/agreement.py:57": 2},
                                    "error_mode": {"raised": True, "at_step": 0},
                                }
                            ]
                        }
                    ],
                }
            }
        },
    },
]


def test_the_report_gives_the_figures_and_where_the_syncs_are():
    result = {
        "command": "python3 -m commopt.gpu_check --out /tmp/o",
        "started": "2026-11-26 14:00 UTC",
        "wall_s": 300.0,
        "budget_s": 420.0,
        "rehearse": False,
        "verdict": "1 passed, 1 failed, 0 skipped",
        "environment": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda": True},
        "stages": SAMPLE_STAGES,
    }
    text = report.render(result)
    assert "NVIDIA H100 80GB HBM3" in text and "1 passed, 1 failed" in text
    assert "| 64 | qsgd4 | 0.133 | 1200.0 | 80% | - | - | 1300.0 | met |" in text
    assert "| 64 | fp16 | 0.500 | 900.0 | 60% | - | - | 1000.0 | missed |" in text
    assert "median of triton.testing.do_bench" in text
    assert "2 host syncs in 5 steps" in text and "commopt/reducer/agreement.py:57 x2" in text
    assert "raised at step 0" in text
    assert "## What one GPU proves, and what needs several" in text


def test_a_missing_result_file_is_named(tmp_path, capsys):
    from commopt.gpu_check import main

    with pytest.raises(SystemExit):
        main(["--from", str(tmp_path / "none.json")])
    assert "no such result file" in capsys.readouterr().err


def test_the_docs_page_is_the_rendered_report():
    want = report.docs_page(ROOT)
    page = (ROOT / "docs" / "benchmarks-gpu.md").read_text()
    assert page == want, "docs/benchmarks-gpu.md is generated: python3 -m commopt.gpu_check --docs"
