"""The device check's stages, in order; each runs its jobs in child processes.

A stage marked ``gpu`` proves something on a CUDA device. Without one (or with
``--rehearse``) the same stage runs its CPU stand-in where the library supports the CPU (the
same job code, CPU tensors, gloo or MPI), so the launching, the result files and the
reporting are exercised before any GPU run; the stage is then reported skipped, with
the reason, and the stand-in's outcome beside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

from commopt.gpu_check.runner import Context, Skip, Stage, StageFailed, require_ok, run_job
from commopt.gpu_check.training_jobs import CSAN_REPORT, SYNC_WARNING
from commopt.testbed.mpirun import mpirun_flavour

#: one job's communicator, its torch.distributed backend (or None) and its launcher.
Run = tuple[str, str | None, str]


def preflight(ctx: Context) -> dict:
    """The machine as it is, first and on its own time (the other stages read it): the
    interpreter, ``nvidia-smi``, each package imported (``mpi4py.MPI`` too: mpi4py installs
    without an MPI library), CUDA initialised by torch and CuPy, the C++ compiler, and which
    MPI's ``mpirun`` is on the PATH."""
    gpu = nvidia_smi()
    ctx.env["nvidia_smi"] = gpu
    # A cold start (torch's first import, CUDA's first context) can outlast one try: retried
    # once with the rest of the stage's time.
    result = run_job(ctx, "env", {"device": "cpu"}, timeout_s=ctx.limit_s / 2)
    retried = None
    if result.failures():
        retried = "; ".join(result.failures())[:300]
        result = run_job(ctx, "env", {"device": "cpu"}, timeout_s=ctx.limit_s - result.wall_s)
    try:
        details = require_ok(result, "the environment probe")[0]
    except StageFailed as exc:
        ctx.env["probe_failed"] = str(exc)
        raise
    if retried:
        details["first_probe_failed"] = retried
    mpirun = shutil.which("mpirun")
    details.update(
        nvidia_smi=gpu,
        mpirun=mpirun,
        mpirun_flavour=mpirun_flavour(mpirun) if mpirun else None,
        compiler=compiler(),
    )
    ctx.env.update(details)
    return details


def nvidia_smi() -> str | None:
    """The GPUs ``nvidia-smi -L`` lists (None without the tool or a GPU): a machine that has
    one must not quietly run the CPU stand-ins when torch fails to see it."""
    path = shutil.which("nvidia-smi")
    if path is None:
        return None
    try:
        proc = subprocess.run([path, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    listed = proc.stdout.strip()
    return listed[:300] if proc.returncode == 0 and listed.startswith("GPU") else None


def compiler() -> str | None:
    """The C++ compiler setuptools would use, if one is installed."""
    cxx = (sysconfig.get_config_var("CXX") or "").split()
    for name in [*cxx[:1], "c++", "g++", "clang++"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def native_build(ctx: Context) -> dict:
    """``python setup.py build_ext --inplace``, then the native kernels against the reference."""
    details: dict = {}
    cc = ctx.env.get("compiler") or compiler()
    if cc is None:
        raise Skip(
            "no C++ compiler here: the native CPU kernels are not built (the reference "
            "torch kernels serve CPU tensors, slowly)"
        )
    argv = [sys.executable, "setup.py", "build_ext", "--inplace"]
    details["command"] = " ".join(["python3", *argv[1:]])
    details["compiler"] = cc
    proc = subprocess.run(
        argv, cwd=ctx.root, capture_output=True, text=True, timeout=max(1.0, ctx.deadline())
    )
    ctx.logs.append(("native_build", details["command"], proc.stdout + proc.stderr))
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise StageFailed(f"the build failed (exit code {proc.returncode})", {"tail": tail})
    details["built"] = "up to date" if "skipping" in proc.stdout + proc.stderr else "compiled"
    details.update(require_ok(run_job(ctx, "native", {"device": "cpu"}), "the native kernels")[0])
    return details


def triton_exact(ctx: Context) -> dict:
    """Triton kernels bit-exact against the reference (on the CPU: under the interpreter)."""
    if not ctx.env.get("triton"):
        raise Skip(
            f"triton is not installed ({ctx.env.get('triton_error', 'not found')}): "
            "pip install 'commopt[triton]'"
        )
    result = run_job(ctx, "triton_exact", {"device": ctx.device})
    details = require_ok(result, "Triton against the reference")[0]
    left = details["planned"] - details["run"]
    if left:
        raise StageFailed(
            f"{left} of {details['planned']} cases not run within the stage's "
            f"{ctx.limit_s:.0f} s (raise --budget-s)",
            details,
        )
    return details


def throughput(ctx: Context) -> dict:
    """Codec kernels against the device copy bandwidth of the same run (reported, not a
    failure: the target is the benchmark's)."""
    result = run_job(ctx, "throughput", {"device": ctx.device, "root": str(ctx.root)})
    return require_ok(result, "the kernel throughput")[0]


def _mpi_launcher(ctx: Context) -> str:
    # with mpirun, a job of one under it; without, an MPI singleton (a plain process)
    return "mpi" if ctx.env.get("mpirun") else "none"


def no_mpi(ctx: Context) -> str | None:
    """Why the runs that need MPI do not run here (None when mpi4py loads an MPI library)."""
    if ctx.env.get("mpi_library"):
        return None
    if not ctx.env.get("mpi4py"):
        return "no MPI library: mpi4py is not installed"
    return (
        f"no MPI library ({ctx.env.get('mpi_error', 'mpi4py found none')[:160]}): carry the "
        "mpich wheel in .whl/ (docs/benchmarks-gpu.md)"
    )


def world_of_one(ctx: Context) -> dict:
    """pure_nccl and torch+nccl in a world of one, every codec through the collectives
    (stand-ins: MPI and gloo on the CPU)."""
    if ctx.on_gpu:
        runs = _nccl_runs(ctx, bootstraps=True)
        missing = _no_cupy(ctx)
        if missing is None:
            missing = _missing_mpi(ctx, "pure_nccl+mpi")
    else:
        runs = [("torch", "gloo", "torch")]
        missing = _missing_mpi(ctx, "mpi")
        if missing is None:
            runs.insert(0, ("mpi", None, _mpi_launcher(ctx)))
    return _each(ctx, "world_of_one", runs, nprocs=1, missing=missing)


def _missing_mpi(ctx: Context, what: str) -> str | None:
    why = no_mpi(ctx)
    return f"{what} not run: {why}" if why else None


def _no_cupy(ctx: Context) -> str | None:
    if not ctx.on_gpu:
        return None
    if not ctx.env.get("cupy_nccl"):
        why = ctx.env.get("cupy_nccl_error") or ctx.env.get("cupy_error") or "NCCL unavailable"
        return f"pure_nccl not run: CuPy with NCCL is missing ({why})"
    return None


def _each(
    ctx: Context,
    job: str,
    runs: list[Run],
    *,
    nprocs: int,
    missing: str | None = None,
    env: dict | None = None,
    extra: dict | None = None,
    count_races: bool = False,
    count_printed_syncs: bool = False,
) -> dict:
    """One job per (communicator, backend, launcher), sharing the stage's time; every run
    is reported, and the stage fails if one did."""
    details: dict = {"runs": {}}
    if missing:
        details["not_run"] = missing
    failures = []
    for i, (comm, backend, launcher) in enumerate(runs):
        label = comm + (f"+{backend}" if backend else "")
        params = dict(
            extra or {}, device=ctx.device, comm=comm, backend=backend, root=str(ctx.root)
        )
        result = run_job(
            ctx,
            job,
            params,
            nprocs=nprocs,
            launcher=launcher,
            env=env,
            timeout_s=ctx.limit_s / (len(runs) - i),
        )
        ctx.limit_s -= result.wall_s
        entry = {
            "launcher": launcher,
            "ranks": [r.get("details") if r else None for r in result.ranks],
            "wall_s": result.wall_s,
        }
        problems = result.failures()
        if count_printed_syncs:
            # torch prints (not warns) the syncs made outside a Python call, e.g. in autograd
            entry["printed_host_syncs"] = result.output.count(SYNC_WARNING)
            if entry["printed_host_syncs"]:
                problems.append(f"{entry['printed_host_syncs']} host syncs printed by torch")
        if count_races:
            entry["sanitizer_reports"] = result.output.count(CSAN_REPORT)
            if entry["sanitizer_reports"]:
                problems.append(f"{entry['sanitizer_reports']} sanitizer reports")
        if problems:
            entry.update(
                failures=problems,
                tracebacks=[r["traceback"] for r in result.ranks if r and r.get("traceback")],
                output_tail=result.tail(),
            )
            failures.append(f"{label}: " + "; ".join(problems))
        details["runs"][label] = entry
    if failures:
        raise StageFailed("; ".join(failures)[:2000], details)
    return details


def two_ranks(ctx: Context) -> dict:
    """Two ranks on the one GPU over gloo, and over MPI where mpirun exists (NCCL refuses two
    ranks on one device: two-rank NCCL needs two GPUs)."""
    runs: list[Run] = [("torch", "gloo", "torch")]
    missing = _missing_mpi(ctx, "mpi")
    if missing is None and not ctx.env.get("mpirun"):
        missing = "mpi not run: mpirun is not installed here"
    if missing is None:
        runs.append(("mpi", None, "mpi"))
    return _each(ctx, "two_ranks", runs, nprocs=2, missing=missing)


def _nccl_runs(ctx: Context, *, bootstraps: bool = False) -> list[Run]:
    """pure_nccl (when CuPy has NCCL; a plain process: no bootstrap, no MPI) and torch's
    nccl, in a world of one. ``bootstraps``: pure_nccl also over torch.distributed's store
    (the torch launcher's env:// variables) and over MPI (where it loads)."""
    runs: list[Run] = [("torch", "nccl", "torch")]
    if ctx.env.get("cupy_nccl"):
        pure = [("pure_nccl", "none", "none")]
        if bootstraps:
            pure.append(("pure_nccl", "store", "torch"))
            if no_mpi(ctx) is None:
                pure.append(("pure_nccl", "mpi", _mpi_launcher(ctx)))
        runs[:0] = pure
    return runs


def _train(ctx: Context, extra: dict, **options) -> dict:
    """The training-loop job on pure_nccl and torch+nccl (the stand-in: gloo on the CPU)."""
    runs: list[Run] = _nccl_runs(ctx) if ctx.on_gpu else [("torch", "gloo", "torch")]
    return _each(ctx, "train", runs, nprocs=1, missing=_no_cupy(ctx), extra=extra, **options)


def host_syncs(ctx: Context) -> dict:
    """Double-buffered and overlapped loops with every host sync counted in the step
    (``set_sync_debug_mode("warn")``), then made an error (``"error"``)."""
    extra = {"steps": 5 if ctx.on_gpu else 2, "count_syncs": True}
    return _train(ctx, extra, count_printed_syncs=True)


def sanitizer(ctx: Context) -> dict:
    """The same loops under ``TORCH_CUDA_SANITIZER=1`` (torch's stream-race detector); each
    race it prints is counted."""
    env = {"TORCH_CUDA_SANITIZER": "1"} if ctx.on_gpu else None
    extra = {"steps": 3 if ctx.on_gpu else 1, "count_syncs": False, "compression": [None]}
    details = _train(ctx, extra, env=env, count_races=True)
    details["sanitizer"] = "on" if env else "off: torch's sanitizer needs CUDA"
    return details


def recipe_amp(ctx: Context) -> dict:
    """The Transformer recipe's smoke preset: fp16 with dynamic loss scaling (alone and with
    double buffering) and bf16 on the GPU; fp32 on the CPU stand-in."""
    for name in ("sentencepiece", "sacrebleu"):
        if not ctx.env.get(name):
            raise Skip(f"the Transformer recipe needs {name} (pip install 'commopt[recipes]')")
    if ctx.on_gpu:
        runs = [["fp16", []], ["fp16", ["--double-buffering"]], ["bf16", []]]
        params = {"runs": runs, "updates": 10, "pairs": 1000}
    else:
        params = {"runs": [["fp32", []]], "updates": 2, "pairs": 200}
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    result = run_job(ctx, "recipe", dict(params, device=ctx.device), env=env)
    return require_ok(result, "the Transformer recipe")[0]


#: name, title, function, weight (its part of the budget), the least seconds it needs on a GPU
#: machine and as a CPU stand-in.
STAGES = [
    Stage(
        "preflight", "Preflight: the machine as it is", preflight, 0, 45, 20, gpu=False, own_s=45
    ),
    # the build compiles for about 7 s of CPU when nothing is built yet
    Stage("native_build", "Native CPU kernels built here", native_build, 1, 25, 20, gpu=False),
    Stage("triton_exact", "Triton kernels bit-exact against the reference", triton_exact, 6, 40, 4),
    Stage("throughput", "Kernel throughput against the copy bandwidth", throughput, 2, 25, 3),
    Stage(
        "world_of_one",
        "pure_nccl and torch+nccl, world of one, every codec",
        world_of_one,
        2,
        30,
        8,
    ),
    Stage("two_ranks", "Two ranks on one GPU (gloo, mpi)", two_ranks, 2, 30, 10),
    Stage("host_syncs", "No host sync in the step (sync debug mode)", host_syncs, 2, 30, 5),
    Stage("sanitizer", "No stream race (TORCH_CUDA_SANITIZER=1)", sanitizer, 3, 40, 5),
    Stage("recipe_amp", "Transformer recipe, AMP smoke steps", recipe_amp, 3, 45, 8),
]
