"""What the device check's child processes run: one job per process, one result file per rank.

    python -m commopt.gpu_check.jobs JOB RESULT_DIR PARAMS_JSON

Each rank writes ``RESULT_DIR/rank<R>.json``: ``{"ok", "details", "error", "traceback"}``,
rewritten as the job goes, so a job killed at its time limit still leaves what it measured.
``PARAMS_JSON`` carries ``device`` ("cuda" or "cpu": the same code runs on the CPU as the
rehearsal's stand-in, where the library supports the CPU) and ``deadline_s``, after which a
job stops starting new cases. The jobs import torch; the parent process never does CUDA work.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from commopt.gpu_check.job import Job
from commopt.gpu_check.kernel_jobs import job_native, job_throughput, job_triton_exact
from commopt.gpu_check.training_jobs import job_recipe, job_train, job_two_ranks, job_world_of_one


def job_env(job: Job) -> None:
    """Versions and what this machine has: CUDA, its memory, Triton, CuPy's NCCL, MPI."""
    import platform

    import torch

    d = job.details
    d.update(
        python=platform.python_version(),
        executable=sys.executable,
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda=torch.cuda.is_available(),
        host=platform.node(),
    )
    if d["cuda"]:
        try:
            free, total = torch.cuda.mem_get_info()
            props = torch.cuda.get_device_properties(0)
            d.update(
                device=torch.cuda.get_device_name(0),
                device_count=torch.cuda.device_count(),
                capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                multiprocessors=props.multi_processor_count,
                memory_free_gib=round(free / 2**30, 1),
                memory_total_gib=round(total / 2**30, 1),
            )
            d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # recorded; the stages that need it will say more
            d["cuda_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for name in ("triton", "cupy", "mpi4py", "numpy", "sentencepiece", "sacrebleu"):
        try:
            d[name] = __import__(name).__version__
        except Exception as exc:  # absent, or broken on import: say which
            d[name] = None
            d[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    _probe_mpi(d)
    if d.get("cupy"):
        try:
            from cupy.cuda import nccl

            d["cupy_nccl"] = bool(nccl.available)
        except Exception as exc:
            d["cupy_nccl"] = False
            d["cupy_nccl_error"] = f"{type(exc).__name__}: {exc}"[:300]
    job.save(ok=True)


def _probe_mpi(d: dict) -> None:
    """Whether mpi4py finds an MPI library (mpi4py installs without one), without starting MPI."""
    if not d.get("mpi4py"):
        d["mpi_library"] = None
        return
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # only the library's name: MPI_Init may start daemons
        from mpi4py import MPI

        d["mpi_library"] = MPI.Get_library_version().strip("\x00 \n").splitlines()[0][:200]
    except Exception as exc:  # mpi4py without a library: "cannot load MPI library"
        d["mpi_library"] = None
        d["mpi_error"] = f"{type(exc).__name__}: {exc}"[:300]


JOBS: dict[str, Callable[[Job], None]] = {
    "env": job_env,
    "native": job_native,
    "triton_exact": job_triton_exact,
    "throughput": job_throughput,
    "world_of_one": job_world_of_one,
    "two_ranks": job_two_ranks,
    "train": job_train,
    "recipe": job_recipe,
}


def main(argv: list[str]) -> int:
    name, result_dir, params = argv[0], Path(argv[1]), json.loads(argv[2])
    job = Job(result_dir, params)
    try:
        JOBS[name](job)
    except Exception as exc:
        job.save(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000], tb=traceback.format_exc())
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
