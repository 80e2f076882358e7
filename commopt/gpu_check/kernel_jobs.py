"""The device check's kernel jobs: the native CPU kernels, the Triton kernels against the
reference, and their throughput against a device copy (run by commopt.gpu_check.jobs)."""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

from commopt.gpu_check.job import Job

#: seconds the Triton check keeps for its buffer above 2^31 bytes (1.1 s on an H200, its
#: kernels compiled), and for any other case (a kernel's first compile takes seconds).
LARGE_CASE_S = 15.0
CASE_MARGIN_S = 15.0


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
    need_s = 10.0  # the first size's guess: compiles and warm-ups dominate
    for mib in job.params.get("mib", [64, 256]):
        if job.time_left() < need_s:
            job.details["not_run"] = (
                f"{mib:g} MiB: about {need_s:.0f} s needed, {max(0.0, job.time_left()):.0f} s left"
            )
            break
        numel = int(mib * 2**20) // 4
        start = time.monotonic()
        result = bench.measure_codecs(numel, job.params.get("reps", 10))
        # the next size: about the time this one took (do_bench times for a fixed time, not
        # a fixed count, and the kernels are compiled now), with a margin
        need_s = 1.5 * (time.monotonic() - start)
        result["mib"] = mib
        job.details["sizes"].append(result)
        job.details["table"] = bench.codec_table(job.details["sizes"])
        job.save(ok=False, error="did not finish")
    job.save(ok=bool(job.details["sizes"]), error=None if job.details["sizes"] else "no size run")
