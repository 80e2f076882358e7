"""SIGKILL a rank at a random moment of a checkpoint save; the previous checkpoint must load.

Each trial starts ``--ranks`` real processes (forked from this one, gloo through the
``torch`` communicator) that train a small MLP with ``qsgd4+ef`` (so every rank has its own
error-feedback residuals) and save a checkpoint after every step through
``commopt.checkpointing.CheckpointManager``, back to back, so that almost every moment of
their life is inside a save. Before saving step ``s`` each rank records a digest of what it
is about to save (model, optimizer state, its residuals); after a save returns it records
``s`` as committed. Once at least one save is complete the script waits a random delay,
SIGKILLs one random rank, then the others a few milliseconds later (as a launcher tearing
down the job does). New processes then resume with ``load_latest`` and compare what they
restored with the digest recorded for that step.

A trial passes when the restored checkpoint loads on every rank, equals the state recorded
for its step on every rank (a *wrong resume* otherwise), and is not older than the last
save any rank saw complete. The record also says what the kill left behind: a staging
folder (killed while writing) or an aside copy (killed between the two renames).

    python benchmarks/kill_during_save.py --trials 100 --out benchmarks/results/kill-during-save.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch


def digest(model, opt) -> str:
    """SHA-256 over the model's and the optimizer's whole state (this rank's residuals too)."""
    h = hashlib.sha256()

    def walk(obj, key=""):
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(obj[k], f"{key}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}/{i}")
        elif isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(f"{key}={obj!r}".encode())

    walk(model.state_dict(), "model")
    walk(opt.state_dict(), "optim")
    return h.hexdigest()


def build(comm, seed: int):
    from commopt.codecs import CompressionPolicy
    from commopt.optim import create_multi_node_optimizer

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        comm,
        model=model,
        compression="qsgd4+ef",
        policy=CompressionPolicy(min_compress_numel=64),
    )
    return model, opt


def train_step(model, opt, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    opt.zero_grad()
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def saver(work: Path, rank: int) -> None:
    """Train and save after every step until killed."""
    import commopt
    from commopt.checkpointing import CheckpointManager

    comm = commopt.create_communicator("torch")
    model, opt = build(comm, seed=0)
    ckpts = CheckpointManager(work / "ckpt", keep=2)
    for step in range(1, 1_000_000):
        train_step(model, opt, step, rank)
        opt.wait()
        _write(work / f"expected.step{step}.rank{rank}", digest(model, opt))
        ckpts.save(step, model, opt, extra={"step": step})
        _write(work / f"committed.rank{rank}", str(step))


def loader(work: Path, rank: int) -> None:
    """Resume from the latest checkpoint and report what came back."""
    import commopt
    from commopt.checkpointing import CheckpointManager

    comm = commopt.create_communicator("torch")
    model, opt = build(comm, seed=123)  # other weights: the checkpoint must win
    report: dict = {"rank": rank}
    try:
        restored = CheckpointManager(work / "ckpt", keep=2).load_latest(model, opt)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    else:
        if restored is None:
            report["step"] = None
        else:
            report["step"] = restored.step
            report["extra_ok"] = restored.extra == {"step": restored.step}
            expected = work / f"expected.step{restored.step}.rank{rank}"
            report["equal"] = expected.is_file() and expected.read_text() == digest(model, opt)
    _write(work / f"loaded.rank{rank}", json.dumps(report))


def fork_ranks(fn, work: Path, ranks: int, tag: str) -> list[int]:
    from commopt.testbed.torch_dist import free_port

    port = free_port()
    pids = []
    for r in range(ranks):
        pid = os.fork()
        if pid == 0:  # the child: one rank
            code = 1
            try:
                out = os.open(work / f"{tag}.rank{r}.log", os.O_WRONLY | os.O_CREAT, 0o644)
                os.dup2(out, 1)
                os.dup2(out, 2)
                os.environ.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    RANK=str(r),
                    WORLD_SIZE=str(ranks),
                    LOCAL_RANK=str(r),
                    LOCAL_WORLD_SIZE=str(ranks),
                    GLOO_SOCKET_IFNAME="lo",
                )
                fn(work, r)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    return pids


def reap(pids: list[int], timeout: float) -> list[int | None]:
    """Exit statuses (None: still running at the deadline, then killed)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * len(pids)
    while time.monotonic() < deadline and None in codes:
        for i, pid in enumerate(pids):
            if codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    for i, pid in enumerate(pids):
        if codes[i] is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return codes


def trial(work: Path, ranks: int, rng: random.Random, max_delay: float, timeout: float) -> dict:
    pids = fork_ranks(saver, work, ranks, "save")
    deadline = time.monotonic() + timeout
    committed = [work / f"committed.rank{r}" for r in range(ranks)]
    while not any(p.exists() for p in committed):
        if time.monotonic() > deadline or any(os.waitpid(p, os.WNOHANG)[0] for p in pids):
            reap(pids, 0)
            logs = {p.name: p.read_text()[-2000:] for p in work.glob("save.rank*.log")}
            raise RuntimeError(f"the savers did not complete a first checkpoint: {logs}")
        time.sleep(0.005)
    delay = rng.uniform(0, max_delay)
    time.sleep(delay)
    victim = rng.randrange(ranks)
    os.kill(pids[victim], signal.SIGKILL)
    time.sleep(rng.uniform(0, 0.02))
    for r, pid in enumerate(pids):
        if r != victim:
            os.kill(pid, signal.SIGKILL)
    reap(pids, timeout)
    last_seen = max(int(p.read_text()) for p in committed if p.exists())
    left = sorted(p.name for p in (work / "ckpt").iterdir() if p.name.startswith("."))
    pids = fork_ranks(loader, work, ranks, "load")
    codes = reap(pids, timeout)
    reports = []
    for r in range(ranks):
        f = work / f"loaded.rank{r}"
        if f.exists():
            reports.append(json.loads(f.read_text()))
        else:
            log = (work / f"load.rank{r}.log").read_text()[-2000:]
            reports.append({"rank": r, "error": f"loader exit {codes[r]}: {log}"})
    steps = {rep.get("step") for rep in reports}
    loadable = all("error" not in rep for rep in reports) and len(steps) == 1
    step = next(iter(steps)) if len(steps) == 1 else None
    wrong = loadable and (
        step is None
        or step < last_seen
        or not all(rep.get("equal") and rep.get("extra_ok") for rep in reports)
    )
    return {
        "delay_s": round(delay, 4),
        "killed_rank": victim,
        "last_seen_committed": last_seen,
        "resumed_step": step,
        "left_behind": left,
        "loadable": loadable,
        "wrong_resume": bool(wrong),
        "errors": [rep["error"] for rep in reports if "error" in rep],
    }


def _preload() -> None:
    """Import in this process what the ranks use: each forked rank then starts at once."""
    import torch.distributed.checkpoint  # noqa: F401

    import commopt
    import commopt.comm.torch_dist
    import commopt.optim.checkpoint_files
    import commopt.optim.checkpoint_manager
    from commopt.testbed.torch_dist import free_port  # noqa: F401

    build(commopt.create_communicator("local"), seed=0)  # the codecs' and optimizer's modules


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--max-delay", type=float, default=0.5, help="seconds after the first save")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120, help="per phase of a trial")
    ap.add_argument("--out", type=Path, help="write the JSON record here")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    torch.set_num_threads(1)  # before any fork: the ranks share the cores
    _preload()
    results = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="commopt-kill-save-") as tmp:
        for i in range(args.trials):
            work = Path(tmp) / f"trial{i}"
            work.mkdir()
            results.append(trial(work, args.ranks, rng, args.max_delay, args.timeout))
            r = results[-1]
            print(
                f"trial {i}: killed rank {r['killed_rank']} after {r['delay_s']:.3f}s, "
                f"last seen {r['last_seen_committed']}, resumed {r['resumed_step']}, "
                f"left {r['left_behind']}, loadable {r['loadable']}, wrong {r['wrong_resume']}"
                + (f", errors {r['errors']}" if r["errors"] else ""),
                flush=True,
            )
            shutil.rmtree(work, ignore_errors=True)
    summary = {
        "trials": len(results),
        "loadable": sum(r["loadable"] for r in results),
        "wrong_resumes": sum(r["wrong_resume"] for r in results),
        "killed_mid_write": sum(
            any(n.endswith(".partial") for n in r["left_behind"]) for r in results
        ),
        "killed_between_renames": sum(
            any(n.endswith(".old") for n in r["left_behind"]) for r in results
        ),
        "resumed_newer_than_seen": sum(
            (r["resumed_step"] or 0) > r["last_seen_committed"] for r in results
        ),
    }
    from commopt.bench import harness

    doc = harness.record(
        __file__,
        argv,
        machine=f"{harness.machine()}, Python {platform.python_version()}",
        load_average=[round(x, 1) for x in os.getloadavg()],
        ranks=args.ranks,
        wall_s=round(time.monotonic() - start, 1),
        summary=summary,
        trials=results,
    )
    print(json.dumps(summary))
    if args.out:
        harness.write_json(args.out, doc)
    return 0 if summary["loadable"] == summary["trials"] and not summary["wrong_resumes"] else 1


if __name__ == "__main__":
    sys.exit(main())
