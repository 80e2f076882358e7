"""The device check's communication and training jobs: collectives in a world of one and on
two ranks, training loops with their host syncs counted, the Transformer recipe (run by
commopt.gpu_check.jobs)."""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from typing import Any

from commopt.gpu_check.job import Job, sync_device

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


def _communicator(params: dict):
    import commopt

    name = params["comm"]
    # the second word of a run's label: torch's backend, or pure_nccl's bootstrap
    option = "bootstrap" if name == "pure_nccl" else "backend"
    options = {option: params["backend"]} if params.get("backend") else {}
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
    d.update(
        communicator=comm.name,
        size=comm.size,
        backend=getattr(comm, "backend", None),
        bootstrap=getattr(comm, "bootstrap", None),
    )
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
    sync_device(device)
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
    sync_device(device)
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
