"""The GPU path checked in one command on a one-GPU machine, as it comes (no network).

    python3 -m commopt.gpu_check [--out DIR] [--rehearse] [--budget-s N] [--report PATH]
    python3 -m commopt.gpu_check --from RESULT.json [--report PATH]
    python3 -m commopt.gpu_check --docs     # docs/benchmarks-gpu.md from the recorded result

``scripts/gpu_check.sh`` runs it with this tree on ``PYTHONPATH`` and ``$OUT`` as the folder.
Stages, in order, each isolated (a failure is recorded with its traceback and the next one
runs) and each given a share of one time budget (default 420 s: the whole check ends within
8 minutes); a stage with too little time left is skipped, saying so:

1. the environment: versions, the device, CuPy's NCCL, ``mpirun``, a C++ compiler;
2. the native CPU kernels built in place (``python setup.py build_ext --inplace``) when a
   compiler exists, and checked against the reference;
3. the Triton kernels bit-exact against the reference on a representative subset;
4. their throughput against the device copy bandwidth measured in the same run;
5. ``pure_nccl`` and ``torch`` (nccl) in a world of one, every codec through the collectives;
6. two ranks on the one GPU over gloo, and over MPI where ``mpirun`` exists;
7. double-buffered and overlapped training steps with host syncs counted in the step
   (``torch.cuda.set_sync_debug_mode``), then made errors;
8. the same loops under ``TORCH_CUDA_SANITIZER=1``, its race reports counted;
9. the Transformer recipe's fp16 and bf16 smoke steps.

Work that touches the GPU runs in child processes (:mod:`commopt.gpu_check.jobs`), killed at
their stage's limit. ``--rehearse`` (and any machine without CUDA) runs every stage's CPU
stand-in instead (the same job code on CPU tensors, over gloo or MPI) and reports the GPU
stages skipped with the reason. The results: ``gpu-check.json``, the report
``gpu-check.md`` and the children's output ``gpu-check-logs.txt`` in the out folder. Exit
status 0 when no stage failed, 1 when one did, 2 when a run without ``--rehearse`` found no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from commopt.gpu_check import report
from commopt.gpu_check.runner import Budget, Context, run_stages

#: seconds for the whole check on a GPU machine, and for a rehearsal.
BUDGET_S = 420.0
REHEARSAL_BUDGET_S = 150.0
#: the most of the children's output kept in the logs file.
LOG_BYTES = 8 * 2**20
ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m commopt.gpu_check", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "out" / "gpu-check",
        help="folder for gpu-check.json, .md and -logs.txt (default out/gpu-check)",
    )
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="CPU stand-ins for every GPU stage: the plumbing, without a GPU",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for the whole check (default {BUDGET_S:g}, rehearsal "
        f"{REHEARSAL_BUDGET_S:g})",
    )
    p.add_argument("--report", type=Path, help="also write the markdown report here")
    p.add_argument(
        "--docs",
        action="store_true",
        help=f"write docs/benchmarks-gpu.md from {report.RECORDED} (the page for no run yet "
        "when there is none); run nothing",
    )
    p.add_argument(
        "--from",
        dest="from_json",
        type=Path,
        help="render the report of this result file; run nothing",
    )
    args = p.parse_args(argv)
    if args.budget_s is not None and args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if args.from_json is not None and not args.from_json.is_file():
        p.error(f"--from {args.from_json}: no such result file (gpu-check.json of a run)")
    return args


def run(args: argparse.Namespace, say=print) -> dict:
    """Run the stages; the result (also written to ``args.out``, after every stage: a run
    stopped from outside leaves the stages it finished)."""
    from commopt.gpu_check.stages import STAGES

    budget_s = args.budget_s or (REHEARSAL_BUDGET_S if args.rehearse else BUDGET_S)
    budget = Budget(budget_s)
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        ctx = Context(root=ROOT, work=Path(work), rehearse=args.rehearse)

        def write(stages: list[dict], *, final: bool = False) -> dict:
            result = _result(args, stages, started=started, start=start, budget_s=budget_s)
            if not final:
                result["verdict"] += f"; stopped early? {len(stages)} of {len(STAGES)} stages ran"
            write_results(args.out, result, ctx.logs)
            return result

        stages = run_stages(STAGES, ctx, budget, say=say, done=write)
        return write(stages, final=True)


def write_results(out: Path, result: dict, logs: list) -> None:
    """gpu-check.json, gpu-check.md and gpu-check-logs.txt, each replaced whole."""
    for name, text in (
        ("gpu-check.json", json.dumps(result, indent=1, default=str) + "\n"),
        ("gpu-check.md", report.render(result)),
        ("gpu-check-logs.txt", _logs_text(logs)),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def _result(args, stages: list[dict], *, started: str, start: float, budget_s: float) -> dict:
    counts = {
        s: sum(1 for x in stages if x["status"] == s) for s in ("passed", "failed", "skipped")
    }
    standins = [x["standin"]["status"] for x in stages if x.get("standin")]
    result = {
        "schema": 1,
        "command": " ".join(["python3 -m commopt.gpu_check", *map(shlex.quote, sys.argv[1:])]),
        "started": started,
        "wall_s": round(time.monotonic() - start, 1),
        "budget_s": budget_s,
        "rehearse": args.rehearse,
        "environment": next((x.get("details") for x in stages if x["name"] == "preflight"), None),
        "stages": stages,
        "counts": counts,
        "standins_failed": standins.count("failed"),
    }
    result["verdict"] = _verdict(result)
    return result


def _verdict(result: dict) -> str:
    c = result["counts"]
    text = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
    if result["standins_failed"]:
        text += f"; {result['standins_failed']} CPU stand-ins failed"
    return text


def _logs_text(logs: list) -> str:
    parts = [f"===== {job}: {what}\n{output}\n" for job, what, output in logs]
    text = "".join(parts)
    if len(text) > LOG_BYTES:
        text = "[earlier output cut]\n" + text[-LOG_BYTES:]
    return text


def exit_status(result: dict) -> int:
    if result["counts"]["failed"] or result["standins_failed"]:
        return 1
    cuda = (result.get("environment") or {}).get("cuda")
    return 0 if result["rehearse"] or cuda else 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.docs:
        (ROOT / "docs" / "benchmarks-gpu.md").write_text(report.docs_page(ROOT))
        return 0
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        text = report.render(result)
        if args.report is None:
            print(text, end="")
        else:
            args.report.write_text(text)
        return 0
    result = run(args, say=lambda msg: print(msg, flush=True))
    text = report.render(result)
    if args.report is not None:
        args.report.write_text(text)
    print(text.split("\n## ")[0], flush=True)  # the summary table
    print(f"[gpu-check] {result['verdict']}; results in {args.out}", flush=True)
    status = exit_status(result)
    if status == 2:
        print(
            "[gpu-check] no CUDA device here: only the CPU stand-ins ran (use --rehearse "
            "to say that is what you want)",
            file=sys.stderr,
        )
    return status
