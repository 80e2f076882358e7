"""The device check's plumbing: a time budget shared by stages, isolated stages, rank jobs.

A stage is a function ``fn(ctx) -> dict`` (its details). It may raise :class:`Skip` with the
reason; any other exception marks it failed, with its traceback, and the next stage runs.
Each stage gets a share of what is left of the budget (its weight over the weights of the
stages still to run, so time one stage does not use goes to the next ones), never less than
its minimum; when less than that minimum is left it is skipped, saying so.

Work that touches the GPU runs in child processes (:func:`run_job`), so a crash, a hang or a
poisoned CUDA context ends that job only: the child is killed at its stage's limit.

    >>> budget = Budget(100.0, clock=iter([0.0, 0.0, 30.0]).__next__)
    >>> budget.share(1.0, 4.0, minimum=5.0)
    25.0
    >>> budget.left()
    70.0
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: seconds kept back from every share for starting and stopping a child process
#: and for writing the results.
RESERVE_S = 3.0
#: the lines of a job's output kept in the results when it fails.
TAIL_LINES = 40


class Skip(Exception):
    """Raised by a stage that does not run here; the message is the reason."""


class Budget:
    """Seconds left of a global budget, and each stage's share of it."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._total = float(seconds)
        self._start = clock()

    @property
    def total(self) -> float:
        return self._total

    def extend(self, seconds: float) -> None:
        """Give back ``seconds`` (a stage with its own time spent them, not the budget)."""
        self._total += seconds

    def left(self) -> float:
        return max(0.0, self._total - (self._clock() - self._start))

    def share(self, weight: float, weights_left: float, *, minimum: float) -> float:
        """This stage's limit: its weight's part of what is left, at least ``minimum``."""
        left = self.left()
        part = left * weight / weights_left if weights_left > 0 else left
        return min(left, max(minimum, part))


@dataclasses.dataclass
class Stage:
    """One check. ``gpu``: it needs a CUDA device (without one it is skipped, saying so)."""

    name: str
    title: str
    fn: Callable[[Context], dict]
    weight: float
    minimum_s: float
    standin_min_s: float
    gpu: bool = True
    #: seconds of its own, outside the shared budget (the preflight: it must run however
    #: the rest is shared)
    own_s: float | None = None


@dataclasses.dataclass
class Context:
    """What a stage may use: where to write, how long it may take, what the machine has."""

    root: Path
    work: Path
    rehearse: bool
    env: dict = dataclasses.field(default_factory=dict)
    limit_s: float = 0.0
    logs: list = dataclasses.field(default_factory=list)

    @property
    def device(self) -> str:
        return "cuda" if self.env.get("cuda") and not self.rehearse else "cpu"

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def why_not_gpu(self) -> str:
        """Why a GPU stage ran only its CPU stand-in here."""
        if self.rehearse:
            return "rehearsal (--rehearse): the CPU stand-in ran in place of the GPU check"
        if self.env.get("probe_failed"):
            return (
                f"the environment probe failed ({self.env['probe_failed'][:200]}): the CPU "
                "stand-in ran in place of the GPU check"
            )
        if self.env.get("nvidia_smi"):
            return (
                f"nvidia-smi lists {self.env['nvidia_smi'][:120]!r} but torch "
                f"{self.env.get('torch', '?')} sees no CUDA device "
                f"({self.env.get('cuda_error', 'torch.cuda.is_available() is False')[:200]}): "
                "the CPU stand-in ran in place of the GPU check"
            )
        return (
            f"no CUDA device (torch {self.env.get('torch', '?')} sees none): the CPU stand-in "
            "ran in place of the GPU check"
        )

    def gpu_missed(self) -> bool:
        """nvidia-smi lists a GPU, but the check could not use it (not a rehearsal)."""
        return bool(self.env.get("nvidia_smi")) and not self.rehearse and not self.on_gpu

    def deadline(self) -> float:
        """Seconds a job of this stage may run (its limit, less the reserve)."""
        return max(1.0, self.limit_s - RESERVE_S)


def run_stages(
    stages: list[Stage],
    ctx: Context,
    budget: Budget,
    *,
    say=print,
    done: Callable[[list[dict]], object] | None = None,
) -> list[dict]:
    """Run every stage in order, each isolated; the result of each, in order. ``done`` is
    called with the results so far after every stage (a run stopped from outside keeps
    them)."""
    results: list[dict] = []
    for i, stage in enumerate(stages):
        weights_left = sum(s.weight for s in stages[i:] if s.own_s is None)
        minimum = stage.minimum_s if ctx.on_gpu else stage.standin_min_s
        if stage.own_s is not None:
            limit = stage.own_s
        else:
            limit = budget.share(stage.weight, weights_left, minimum=minimum)
        entry: dict[str, Any] = {
            "name": stage.name,
            "title": stage.title,
            "gpu": stage.gpu,
            "limit_s": round(limit, 1),
        }
        start = time.monotonic()
        left_before = budget.left()
        if limit < minimum:
            entry.update(
                status="skipped",
                reason=f"time budget: {limit:.0f} s left of {budget.total:.0f} s, the stage "
                f"needs at least {minimum:.0f} s (raise --budget-s)",
            )
        else:
            ctx.limit_s = limit
            say(f"[gpu-check] {stage.name}: up to {limit:.0f} s")
            outcome = _attempt(stage, ctx)
            if stage.gpu and not ctx.on_gpu:
                # a machine with a GPU that only ran the stand-in has failed the check
                status = "failed" if ctx.gpu_missed() else "skipped"
                entry.update(status=status, reason=ctx.why_not_gpu(), standin=outcome)
            else:
                entry.update(outcome)
        entry["wall_s"] = round(time.monotonic() - start, 2)
        if stage.own_s is not None:  # its time was its own: the shared budget gets it back
            budget.extend(left_before - budget.left())
        say(f"[gpu-check] {stage.name}: {entry['status']} ({entry['wall_s']:.1f} s)")
        results.append(entry)
        if done is not None:
            done(results)
    return results


def _attempt(stage: Stage, ctx: Context) -> dict:
    """The stage's outcome: passed with details, skipped with the reason, or failed with the
    error, its traceback and what was measured before it."""
    try:
        return {"status": "passed", "details": stage.fn(ctx)}
    except Skip as why:
        return {"status": "skipped", "reason": str(why)}
    except Exception as exc:
        return {
            "status": "failed",
            "reason": f"{type(exc).__name__}: {exc}".strip()[:2000],
            "traceback": traceback.format_exc()[-6000:],
            "details": getattr(exc, "details", None),
        }


class StageFailed(Exception):
    """A failed check, with what the stage measured before it failed."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details


# ----------------------------------------------------------------------------- rank jobs


@dataclasses.dataclass
class JobResult:
    """What the ranks of one job wrote (None for a rank that wrote nothing) and its output."""

    returncode: int | None
    ranks: list[dict | None]
    output: str
    wall_s: float

    def tail(self) -> str:
        return "\n".join(self.output.strip().splitlines()[-TAIL_LINES:])

    def failures(self) -> list[str]:
        """One line per rank that failed or wrote nothing, naming the rank."""
        out = []
        for r, rank in enumerate(self.ranks):
            if rank is None:
                why = (
                    "timed out"
                    if self.returncode is None
                    else f"wrote no result (exit code {self.returncode})"
                )
                out.append(f"rank {r} {why}")
            elif not rank.get("ok"):
                out.append(f"rank {r}: {rank.get('error', 'failed')}")
        if not out and self.returncode is None:
            out.append(
                "every rank wrote its result, then the job ran past its time limit "
                "(slow or stuck at exit)"
            )
        elif not out and self.returncode != 0:
            out.append(f"every rank wrote its result, then the job exited with {self.returncode}")
        return out


def job_argv(job: str, params: dict, result_dir: Path) -> list[str]:
    """The command line of one rank of ``job`` (commopt.gpu_check.jobs), run by this Python."""
    return [
        sys.executable,
        "-m",
        "commopt.gpu_check.jobs",
        job,
        str(result_dir),
        json.dumps(params),
    ]


def run_job(
    ctx: Context,
    job: str,
    params: dict,
    *,
    nprocs: int = 1,
    launcher: str = "none",
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> JobResult:
    """Run ``job`` on ``nprocs`` ranks and collect what each wrote.

    ``launcher``: ``none`` (one plain process: for MPI, a singleton), ``torch`` (``commopt
    launch --launcher torch``: MASTER_ADDR/PORT on 127.0.0.1) or ``mpi`` (``commopt launch``,
    mpirun). Killed after ``timeout_s`` (default: the stage's limit).
    """
    timeout = max(1.0, (timeout_s or ctx.limit_s) - 1.0)
    result_dir = Path(tempfile.mkdtemp(prefix=f"{job}-", dir=ctx.work))
    params = dict(params, deadline_s=max(1.0, timeout - RESERVE_S))
    argv = job_argv(job, params, result_dir)
    if launcher != "none":
        from commopt.commands.launch import launch_argv

        argv = launch_argv(
            nprocs, "--launcher", launcher, "--timeout", f"{timeout:.0f}", "--", *argv
        )
    elif nprocs != 1:
        raise ValueError("launcher='none' runs one process; name a launcher for more ranks")
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ctx.root), child_env.get("PYTHONPATH", "")) if p
    )
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.update(env or {})
    log = result_dir / "output.log"
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            argv,
            cwd=ctx.root,
            env=child_env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(timeout=timeout + 5.0)
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    output = log.read_text(errors="replace")
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    ctx.logs.append((job, f"{shown} {shlex.join(argv)}".strip(), output))
    ranks = []
    for r in range(nprocs):
        path = result_dir / f"rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    if code == 124 and launcher != "none":
        code = None  # commopt launch's own timeout
    return JobResult(code, ranks, output, round(time.monotonic() - start, 2))


def require_ok(result: JobResult, what: str) -> list[dict]:
    """The ranks' details; raises StageFailed naming each rank that failed."""
    failures = result.failures()
    if failures:
        details = {
            "ranks": [r.get("details") if r else None for r in result.ranks],
            "tracebacks": [r.get("traceback") for r in result.ranks if r and r.get("traceback")],
            "output_tail": result.tail(),
        }
        raise StageFailed(f"{what}: " + "; ".join(failures), details)
    return [r["details"] for r in result.ranks if r is not None]
