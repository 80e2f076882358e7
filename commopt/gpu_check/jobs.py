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
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the codecs each collective check runs, with the largest error allowed, as a share of
#: max|x|, of one decode(encode(x)) (a world of one: the reduction is that round trip).
CODEC_BOUNDS = {
    "none": 0.0,
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
    "qsgd8": 1 / 127,
    "qsgd4": 1 / 7,
    "qsgd2": 1.0,
    "qsgd4+ef": 1 / 7,
}
#: torch's words for a host synchronisation under ``set_sync_debug_mode``.
SYNC_WARNING = "called a synchronizing CUDA operation"
#: what torch's CUDA sanitizer prints once per race it finds.
CSAN_REPORT = "CSAN detected a possible data race"
#: seconds the Triton check keeps for its buffer above 2^31 bytes, and for any other case (a
#: kernel's first compile takes seconds).
LARGE_CASE_S = 45.0
CASE_MARGIN_S = 15.0


class Job:
    """One rank's result file, written as the job goes."""

    def __init__(self, result_dir: Path, params: dict):
        from commopt.comm.launcher import detect_launcher

        self.params = params
        self.rank = detect_launcher().rank
        self.path = Path(result_dir) / f"rank{self.rank}.json"
        self.details: dict[str, Any] = {}
        self._end = time.monotonic() + float(params.get("deadline_s", 60.0))
        self.save(ok=False, error="did not finish (killed at its time limit?)")

    @property
    def device(self) -> str:
        return self.params.get("device", "cpu")

    def time_left(self) -> float:
        return self._end - time.monotonic()

    def save(self, *, ok: bool, error: str | None = None, tb: str | None = None) -> None:
        record = {"ok": ok, "details": self.details, "error": error, "traceback": tb}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        tmp.replace(self.path)


def _sync_device(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- environment


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
    if d.get("cupy"):
        try:
            from cupy.cuda import nccl

            d["cupy_nccl"] = bool(nccl.available)
        except Exception as exc:
            d["cupy_nccl"] = False
            d["cupy_nccl_error"] = f"{type(exc).__name__}: {exc}"[:300]
    job.save(ok=True)


def job_native(job: Job) -> None:
    """The native CPU kernels load and write the reference's bits."""
    import torch

    from commopt import kernels
    from commopt.kernels import native

    if not kernels.native_available():
        raise RuntimeError(f"commopt_ext._cpu does not load: {native.load_error()}")
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
    nbytes = kernels.qsgd_nbytes(x.numel(), bits=4, bucket_size=128)
    wires = {}
    for impl in ("native", "reference"):
        wires[impl] = torch.empty(nbytes, dtype=torch.uint8)
        kernels.qsgd_encode(
            x, wires[impl], bits=4, levels=7, bucket_size=128, key=(3, 4), impl=impl
        )
    job.details["qsgd4_native_equals_reference"] = torch.equal(wires["native"], wires["reference"])
    if not job.details["qsgd4_native_equals_reference"]:
        raise AssertionError("native qsgd4 encode differs from the reference")
    job.save(ok=True)


# ----------------------------------------------------------------------------- Triton kernels


def exactness_cases(full: bool) -> list[dict]:
    """A representative subset: every bit width and rounding mode on both encode paths
    (one pass with max norms; two passes with l2 norms, half scales and buckets starting inside
    a byte), a max norm wider than a tile, the three casts; ragged sizes throughout. Few
    distinct kernel specialisations: each costs a compile of seconds on first use. Without
    ``full`` (the interpreter, on the CPU), one case of each path on one small size."""
    cases: list[dict] = []
    for n in [4_099, 1_000_003] if full else [1_003]:
        qsgd = dict(kind="qsgd", n=n, scale_bytes=4, bucket_size=128, norm="max")
        l2 = dict(qsgd, bucket_size=127, norm="l2", scale_bytes=2)
        if full:
            cases += [
                dict(qsgd, bits=bits, stochastic=stochastic)
                for bits in (2, 4, 8)
                for stochastic in (True, False)
            ]
            cases += [dict(l2, bits=bits, stochastic=bits != 4) for bits in (2, 4, 8)]
        else:
            cases += [dict(qsgd, bits=4, stochastic=True), dict(l2, bits=2, stochastic=False)]
        cases.append(dict(qsgd, bits=4, bucket_size=4097, stochastic=True))
        dtypes = ("float16", "bfloat16", "float32") if full else ("bfloat16",)
        cases += [dict(kind="cast", n=n, dtype=d) for d in dtypes]
    return cases


def _label(case: dict) -> str:
    if case["kind"] == "cast":
        return f"cast {case['dtype']} n={case['n']}"
    rounding = "stochastic" if case["stochastic"] else "nearest"
    return (
        f"qsgd{case['bits']} {case['norm']} {rounding} bucket={case['bucket_size']} "
        f"scales={case['scale_bytes']}B n={case['n']}"
    )


def _input(n: int, seed: int, device: str):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    if n > 10:
        x[3], x[n // 2], x[-2] = 1e-41, float("inf"), float("nan")
    return x.to(device)


def _check_case(case: dict, device: str, ref_device: str, x=None) -> dict:
    """Encode and decode with the Triton kernels on ``device`` and with the reference on
    ``ref_device``; raises AssertionError naming what differs."""
    import torch

    from commopt import kernels
    from commopt.kernels.reference import same_bits, same_wire

    n = case["n"]
    x = _input(n, n + case.get("bits", 0), "cpu") if x is None else x
    if case["kind"] == "cast":
        dtype = getattr(torch, case["dtype"])
        want = torch.empty(n, dtype=dtype, device=ref_device)
        got = torch.empty(n, dtype=dtype, device=device)
        kernels.cast_encode(x.to(ref_device), want, scale=1 / 3, impl="reference")
        kernels.cast_encode(x.to(device), got, scale=1 / 3, impl="triton")
        assert same_bits(got, want), "cast encode differs"
        out_ref = torch.ones(n, device=ref_device)
        out = torch.ones(n, device=device)
        kernels.cast_decode(want, out_ref, accumulate=True, alpha=0.25, impl="reference")
        kernels.cast_decode(want.to(device), out, accumulate=True, alpha=0.25, impl="triton")
        assert same_bits(out, out_ref), "cast decode differs"
        return {}
    bits = case["bits"]
    cfg = {k: case[k] for k in ("bits", "bucket_size", "norm", "stochastic", "scale_bytes")}
    cfg.update(levels=2 ** (bits - 1) - 1, scale=0.5, key=(12345, 2**32 - 3))
    nbytes = kernels.qsgd_nbytes(
        n, bits=bits, bucket_size=case["bucket_size"], scale_bytes=case["scale_bytes"]
    )
    want = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=ref_device)
    got = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=device)
    kernels.qsgd_encode(x.to(ref_device), want, impl="reference", **cfg)
    kernels.qsgd_encode(x.to(device), got, impl="triton", **cfg)
    assert same_wire(got, want, n, case["bucket_size"], case["scale_bytes"]), "encode differs"
    params = {k: cfg[k] for k in ("bits", "levels", "bucket_size", "scale_bytes")}
    start = torch.linspace(-3.0, 3.0, n, device=ref_device)
    for accumulate, alpha in ((False, 1.0), (True, -1.0)):
        out_ref, out = start.clone(), start.to(device, copy=True)
        kernels.qsgd_decode(
            want, out_ref, accumulate=accumulate, alpha=alpha, impl="reference", **params
        )
        kernels.qsgd_decode(
            want.to(device), out, accumulate=accumulate, alpha=alpha, impl="triton", **params
        )
        assert same_bits(out, out_ref), f"decode (accumulate={accumulate}) differs"
    return {"wire_bytes": nbytes}


def _compiled_variants() -> int | None:
    """How many kernel specialisations Triton compiled in this process (None if unknown)."""
    import triton

    from commopt.kernels import triton as tk

    if tk.INTERPRETED:
        return None
    total = 0
    kernels = [v for v in vars(tk).values() if isinstance(v, triton.runtime.JITFunction)]
    try:
        for fn in kernels:
            for entry in fn.device_caches.values():  # Triton 3.x: (kernel cache, ...)
                total += len(entry[0] if isinstance(entry, tuple) else entry)
    except (AttributeError, TypeError):  # another Triton's layout: unknown
        return None
    return total if kernels else None


def job_triton_exact(job: Job) -> None:
    """The Triton kernels against the reference, case by case until the deadline."""
    import torch

    from commopt import kernels

    device = job.device
    full = device == "cuda"
    kernels.triton_interpreted()  # loads the kernels (under the interpreter on the CPU)
    cases = exactness_cases(full)
    rows = job.details.setdefault("cases", [])
    job.details["planned"] = len(cases) + (1 if full else 0)
    failed = 0
    margin = CASE_MARGIN_S if full else 0.0
    for case in cases:
        if job.time_left() < margin:
            break
        start = time.monotonic()
        row: dict[str, Any] = {"case": _label(case)}
        try:
            row.update(_check_case(case, device, "cpu"))
            row["ok"] = True
        except AssertionError as exc:
            row.update(ok=False, error=str(exc))
            failed += 1
        except Exception as exc:  # a compile or launch error: recorded, the next case runs
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:1000])
            job.details.setdefault("first_traceback", traceback.format_exc()[-4000:])
            failed += 1
        row["s"] = round(time.monotonic() - start, 3)
        rows.append(row)
        job.save(ok=False, error="did not finish")
    if full and job.time_left() > LARGE_CASE_S:
        rows.append(_large_case(job))
        failed += not rows[-1].get("ok", True)
    job.details["run"] = len(rows)
    job.details["compiled_variants"] = _compiled_variants()
    if device == "cuda":
        job.details["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    job.save(ok=failed == 0, error=f"{failed} cases differ from the reference" if failed else None)


def _large_case(job: Job) -> dict:
    """One buffer above 2^31 bytes (64-bit indices), reference computed on the device: first
    checked against the CPU reference on a smaller buffer of the same configuration."""
    import torch

    n = 2**29 + 5  # float32: 2 GiB + 20 bytes
    case = dict(
        kind="qsgd", n=n, bits=4, bucket_size=128, norm="max", stochastic=True, scale_bytes=4
    )
    row: dict[str, Any] = {"case": _label(case) + " (reference on the device)"}
    free = torch.cuda.mem_get_info()[0]
    if free < 24 * 2**30:
        return dict(row, skipped=f"needs 24 GiB free, {free / 2**30:.1f} GiB are")
    start = time.monotonic()
    try:
        small = dict(case, n=1_000_003)
        x = _input(1_000_003, 7, "cpu")
        _check_case(small, "cuda", "cpu", x)  # both pass: the two references agree
        _check_case(small, "cuda", "cuda", x.cuda())
        x = torch.randn(n, device="cuda")
        x[n - 3] = float("inf")
        row.update(_check_case(case, "cuda", "cuda", x))
        row["ok"] = True
    except AssertionError as exc:
        row.update(ok=False, error=str(exc))
    except torch.cuda.OutOfMemoryError as exc:
        row.update(skipped=f"out of memory: {str(exc)[:200]}")
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:1000])
    row["s"] = round(time.monotonic() - start, 3)
    torch.cuda.empty_cache()
    return row


def _gpu_bench(root: Path):
    import importlib.util

    path = root / "benchmarks" / "gpu_bench.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run the check from a source checkout")
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job_throughput(job: Job) -> None:
    """Every codec's encode and decode against a device copy of the same buffer
    (benchmarks/gpu_bench.py's measurement), at 64 MiB and, time allowing, 256 MiB."""
    bench = _gpu_bench(Path(job.params["root"]))
    job.details.update(target=bench.ENCODE_TARGET, codecs=list(bench.CODECS), sizes=[])
    if job.device != "cuda":  # the stand-in: the benchmark's codecs exist and load
        job.details["codecs_built"] = [
            bench.make_codec(name).encoded_nbytes(1024) > 0 for name in bench.CODECS
        ]
        job.save(ok=True)
        return
    for mib in job.params.get("mib", [64, 256]):
        if job.time_left() < 0:
            break
        numel = int(mib * 2**20) // 4
        result = bench.measure_codecs(numel, job.params.get("reps", 10))
        result["mib"] = mib
        job.details["sizes"].append(result)
        job.save(ok=False, error="did not finish")
    job.save(ok=bool(job.details["sizes"]), error=None if job.details["sizes"] else "no size run")


# ----------------------------------------------------------------------------- collectives


def _communicator(params: dict):
    import commopt

    name = params["comm"]
    options = {"backend": params["backend"]} if params.get("backend") else {}
    return commopt.create_communicator(name, **options)


def _set_device(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU


def job_world_of_one(job: Job) -> None:
    """A world of one: raw allreduce of every dtype, and the collectives with every codec
    (scatter-reduce, so the codec runs, and the automatic choice)."""
    import torch

    from commopt import collectives
    from commopt.codecs import RngKey, get_codec

    device = job.device
    _set_device(device)
    comm = _communicator(job.params)
    d = job.details
    d.update(communicator=comm.name, size=comm.size, backend=getattr(comm, "backend", None))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.arange(1031, device=device).to(dtype)
        comm.allreduce(t)
        assert torch.equal(t, torch.arange(1031, device=device).to(dtype)), dtype
    d["raw_allreduce"] = "float32, float16, bfloat16 unchanged"
    x = torch.randn(100_003, device=device)
    rows = d.setdefault("codecs", [])
    bad = []
    for name, bound in CODEC_BOUNDS.items():
        for algorithm in ("scatter_reduce", "auto"):
            t = x.clone()
            try:
                work = collectives.allreduce(
                    comm,
                    t,
                    get_codec(name),
                    algorithm=algorithm,
                    rng=RngKey(0, 0, 1),
                    key="b",
                    async_op=True,
                )
                work.wait()
                err = float((t - x).abs().max()) / float(x.abs().max())
            except Exception as exc:  # recorded; the next codec runs
                rows.append(
                    {
                        "codec": name,
                        "algorithm": algorithm,
                        "rel_error": None,
                        "ok": False,
                        "error": f"{type(exc).__name__}: {exc}"[:1000],
                    }
                )
                bad.append(f"{name}/{algorithm}: {type(exc).__name__}")
                job.details.setdefault("first_traceback", traceback.format_exc()[-4000:])
                continue
            ok = t.device.type == device and err <= bound * 1.01
            rows.append({"codec": name, "algorithm": algorithm, "rel_error": err, "ok": ok})
            if not ok:
                bad.append(f"{name}/{algorithm}: error {err:.3g} > {bound:.3g}")
    comm.finalize()
    job.save(ok=not bad, error="; ".join(bad) or None)


def job_two_ranks(job: Job) -> None:
    """Two ranks on one device over a host-ordered transport: sums, codecs, a buffer filled
    on a side stream behind a sleep (the transport must wait for it), a double-buffered loop."""
    import torch

    from commopt import collectives
    from commopt.codecs import RngKey, get_codec

    device = job.device
    _set_device(device)
    comm = _communicator(job.params)
    d = job.details
    d.update(communicator=comm.name, size=comm.size, rank=comm.rank)
    total = comm.size * (comm.size + 1) / 2
    t = torch.full((1000,), float(comm.rank + 1), device=device)
    comm.allreduce(t)
    d["sum"] = bool(torch.all(t == total))
    assert d["sum"], f"allreduce gave {t[:4].tolist()}, want {total}"
    mean = total / comm.size
    for name in ("fp16", "qsgd4"):
        t = torch.full((100_003,), float(comm.rank + 1), device=device)
        collectives.allreduce(
            comm,
            t,
            get_codec(name),
            algorithm="scatter_reduce",
            rng=RngKey(0, comm.rank, 1),
            key="b",
        )
        err = float((t - mean).abs().max()) / mean
        d[f"{name}_rel_error"] = err
        assert err <= CODEC_BOUNDS[name] * 1.01, f"{name}: error {err:.3g}"
    if device == "cuda":
        d["side_stream"] = _side_stream_ordering(comm)
    d["double_buffered_loop"] = _two_rank_loop(comm, device)
    comm.finalize()
    job.save(ok=True)


def _side_stream_ordering(comm) -> str:
    import torch

    from commopt import collectives

    side = torch.cuda.Stream()
    n = 1 << 20
    for trial in range(3):
        flat = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)  # the fill comes late
            flat.fill_(comm.rank + 1.0)
            work = collectives.allreduce(comm, flat, None, average=False, async_op=True)
            work.wait()
            seen = flat.clone()  # on the side stream, after wait()
        torch.cuda.synchronize()
        want = comm.size * (comm.size + 1) / 2
        assert torch.all(seen == want), f"trial {trial}: saw {seen[:4].tolist()}, want {want}"
    return "3 trials: the reduction saw the side stream's late fill"


def _two_rank_loop(comm, device: str) -> str:
    import torch

    import commopt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model.to(device)
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        comm,
        model=model,
        double_buffering=True,
        compression="qsgd4",
        bucket_cap_mb=0.01,
    )
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=g).to(device)).square().mean().backward()
        opt.step()
    opt.flush()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    avg = flat.clone()
    comm.allreduce(avg)
    assert torch.equal(avg / comm.size, flat), "the ranks' weights differ after flush()"
    return "4 steps, qsgd4: the ranks' weights agree after flush()"


# ----------------------------------------------------------------------------- training loops


class SyncCounter:
    """Host synchronisations torch reports under ``set_sync_debug_mode("warn")``, by phase
    and by the Python line that asked for them. A no-op without CUDA."""

    def __init__(self, enabled: bool, root: str):
        self.enabled = enabled
        self.root = root
        self.phase = "none"
        self.counts: Counter = Counter()
        self.where: Counter = Counter()
        self._catch: Any = None
        self._log: list = []

    def __enter__(self) -> SyncCounter:
        if self.enabled:
            import torch

            self._catch = warnings.catch_warnings(record=True)
            self._log = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def mark(self, phase: str) -> None:
        self._collect()
        self.phase = phase

    def _collect(self) -> None:
        for w in self._log:
            if SYNC_WARNING in str(w.message):
                self.counts[self.phase] += 1
                where = os.path.relpath(w.filename, self.root)
                self.where[f"{self.phase}: {where}:{w.lineno}"] += 1
        self._log.clear()

    def __exit__(self, *exc) -> None:
        if self.enabled:
            import torch

            self._collect()
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)


def _training(comm, device: str, double_buffering: bool, compression):
    """A small MLP under commopt's optimizer; ``step(counter)`` runs one training step."""
    import torch

    import commopt

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(3):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10)).to(device)
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        comm,
        model=model,
        double_buffering=double_buffering,
        overlap=True,
        compression=compression,
        bucket_cap_mb=1,
    )
    x = torch.randn(64, 512, device=device)
    y = torch.randint(0, 10, (64,), device=device)

    def step(counter: SyncCounter) -> None:
        counter.mark("forward and backward")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        counter.mark("step")
        opt.step()
        counter.mark("between steps")

    for _ in range(3):  # warm-up: buckets, the first broadcast, allocations
        step(SyncCounter(False, ""))
    _sync_device(device)
    return model, opt, step


def _loop(
    comm,
    device: str,
    *,
    double_buffering: bool,
    compression,
    steps: int,
    root: str,
    count_syncs: bool,
) -> dict:
    """Training steps with the host syncs of each phase counted (on CUDA)."""
    import torch

    model, opt, step = _training(comm, device, double_buffering, compression)
    result: dict[str, Any] = {"steps_counted": steps, "buckets": len(opt.buckets)}
    counter = SyncCounter(count_syncs and device == "cuda", root)
    with counter:
        for _ in range(steps):
            step(counter)
    result["host_syncs"] = dict(counter.counts)
    result["host_syncs_total"] = sum(counter.counts.values())
    result["sync_sites"] = dict(counter.where.most_common(10))
    result["counted"] = counter.enabled
    _sync_device(device)
    opt.flush()
    result["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    result["applied_steps"] = opt.applied_steps
    return result


def _error_mode(comm, *, double_buffering: bool, compression, steps: int) -> dict:
    """Fresh training steps with any host sync raising (``set_sync_debug_mode("error")``)."""
    import torch

    _, _, step = _training(comm, "cuda", double_buffering, compression)
    off = SyncCounter(False, "")
    torch.cuda.set_sync_debug_mode("error")
    done = 0
    try:
        for done in range(steps):  # noqa: B007 - the step that raised is reported
            step(off)
    except Exception as exc:
        return {
            "raised": True,
            "at_step": done,
            "error": f"{type(exc).__name__}: {exc}"[:500],
            "traceback": traceback.format_exc()[-3000:],
        }
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"raised": False, "steps": steps}


def job_train(job: Job) -> None:
    """Double-buffered and overlapped training steps, each with and without compression;
    host syncs counted (and made errors) in the step on CUDA."""
    device = job.device
    _set_device(device)
    comm = _communicator(job.params)
    job.details.update(communicator=comm.name, backend=getattr(comm, "backend", None))
    loops = job.details.setdefault("loops", [])
    problems = []
    steps, count = job.params.get("steps", 5), job.params.get("count_syncs", True)
    for double_buffering in (True, False):
        for compression in job.params.get("compression", [None, "qsgd4"]):
            if job.time_left() < 0:
                break
            name = f"{'double-buffered' if double_buffering else 'overlapped'}, {compression}"
            options: dict[str, Any] = dict(
                double_buffering=double_buffering, compression=compression, steps=steps
            )
            entry: dict[str, Any] = {"loop": name}
            loops.append(entry)
            try:
                entry.update(
                    _loop(comm, device, root=job.params["root"], count_syncs=count, **options)
                )
                if count and device == "cuda":
                    job.save(ok=False, error="did not finish")
                    entry["error_mode"] = _error_mode(comm, **options)
            except Exception as exc:
                entry.update(
                    error=f"{type(exc).__name__}: {exc}"[:2000],
                    traceback=traceback.format_exc()[-4000:],
                )
                problems.append(f"{name}: {type(exc).__name__}")
                job.save(ok=False, error="; ".join(problems))
                continue
            if entry["host_syncs_total"]:
                problems.append(f"{name}: {entry['host_syncs_total']} host syncs counted")
            if entry.get("error_mode", {}).get("raised"):
                problems.append(f"{name}: a host sync raised in error mode")
            if not entry["finite"]:
                problems.append(f"{name}: non-finite weights")
            job.save(ok=False, error="did not finish")
    comm.finalize()
    job.save(ok=not problems, error="; ".join(problems) or None)


# ----------------------------------------------------------------------------- the recipe


def job_recipe(job: Job) -> None:
    """The Transformer recipe's smoke preset: a few updates per precision."""
    import math
    import tempfile
    from importlib import import_module

    # the recipes are the tree's, beside the library (not part of the installed package)
    train = import_module("recipes.transformer.train")
    write_smoke_corpus = import_module("recipes.transformer.smoke_corpus").write_smoke_corpus

    runs = job.details.setdefault("runs", [])
    with tempfile.TemporaryDirectory(prefix="recipe-") as tmp:
        write_smoke_corpus(
            f"{tmp}/data", sizes={"train": job.params.get("pairs", 1000), "valid": 20, "test": 20}
        )
        for precision, extra in job.params["runs"]:
            if job.time_left() < 0:
                break
            updates = job.params.get("updates", 10)
            trainer = train.run(
                [
                    "--preset",
                    "smoke",
                    "--data",
                    f"{tmp}/data",
                    "--save-dir",
                    f"{tmp}/run-{precision}-{len(runs)}",
                    "--precision",
                    precision,
                    "--device",
                    job.device,
                    "--max-update",
                    str(updates),
                    "--no-progress-bar",
                    "--final-eval",
                    "none",
                    "--vocab-size",
                    "300",
                    *extra,
                ]
            )
            scaler = getattr(trainer, "scaler", None)
            row = {
                "precision": precision,
                "options": " ".join(extra),
                "updates": trainer.num_updates,
                "valid_loss": trainer.best_valid_loss,
                "loss_scale": scaler.get_scale() if scaler is not None else None,
                "device": str(trainer.device),
            }
            runs.append(row)
            assert trainer.num_updates == updates, row
            assert math.isfinite(trainer.best_valid_loss), row
            assert trainer.device.type == job.device, row
            job.save(ok=False, error="did not finish")
    job.save(ok=bool(runs), error=None if runs else "no run")


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
