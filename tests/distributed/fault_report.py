"""Run the fault matrix and write docs/reliability.md from what it recorded.

    $ python -m tests.distributed.fault_report                 # run, then write the page
    $ python -m tests.distributed.fault_report --from-json benchmarks/results/fault-matrix.json
    $ python -m tests.distributed.fault_report --only horovod  # run a subset, merge, write

The run's records (one per case: expected behaviour, outcome, seconds to a clean exit) go to
``--json`` (default benchmarks/results/fault-matrix.json) with the command, date and machine;
the page is made from that file alone, so no count or time in it is written by hand.
``--only PATTERN`` runs the cases pytest's ``-k PATTERN`` selects and merges their rows into
the existing file (a row of the same test is replaced, a new one goes after its test's
siblings); the subset's command, date and load are listed beside the full run's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests/distributed/test_fault_matrix.py"
DEFAULT_JSON = REPO / "benchmarks" / "results" / "fault-matrix.json"
DEFAULT_OUT = REPO / "docs" / "reliability.md"


def run_matrix(json_path: Path, pytest_args: list[str]) -> dict:
    """Run the module under pytest; return the records plus how they were made."""
    from tests.distributed.test_fault_matrix import RECORDS_ENV

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", MODULE, *pytest_args]
    env = dict(os.environ, **{RECORDS_ENV: str(json_path)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    load_start = os.getloadavg()[0]
    t = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), check=False)  # failures are recorded
    doc = json.loads(json_path.read_text())
    doc["run"] = {
        "command": "python -m tests.distributed.fault_report"
        + (" -- " + " ".join(pytest_args) if pytest_args else ""),
        "pytest_exit_code": proc.returncode,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_average": [round(load_start, 1), round(os.getloadavg()[0], 1)],
        "wall_s": round(time.monotonic() - t, 1),
    }
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _function(nodeid: str) -> str:
    return nodeid.split("[")[0]


def _module_order() -> list[str]:
    """The matrix's test functions in the order the module defines them."""
    return re.findall(r"^def (test_\w+)", (REPO / MODULE).read_text(), re.M)


def merge(old: dict, new: dict, pattern: str, module_order: list[str] | None = None) -> dict:
    """``old``'s rows with ``new``'s (a subset run with ``-k pattern``) merged in, by test id."""
    fresh: dict[str, list[dict]] = {}
    for row in new["cases"]:
        fresh.setdefault(row["test"], []).append(row)
    cases: list[dict] = []
    replaced: set[str] = set()
    for row in old["cases"]:
        if row["test"] in fresh:
            replaced.add(row["test"])
            cases.extend(fresh.pop(row["test"]))  # a test's rows are replaced together
        elif row["test"] not in replaced:  # (its later rows went with its first)
            cases.append(row)
    # New tests: after the last row of the same function, or of the functions above theirs
    # in the module (pytest's order), so the page keeps the module's order.
    order = module_order or _module_order()
    for test, rows in fresh.items():
        name = _function(test).split("::")[-1]
        before = set(order[: order.index(name) + 1]) if name in order else {name}
        at = max(
            (i + 1 for i, r in enumerate(cases) if _function(r["test"]).split("::")[-1] in before),
            default=len(cases),
        )
        cases[at:at] = rows
    subset = dict(new.get("run", {}), only=pattern)
    merged = dict(old, cases=cases)
    merged["subset_runs"] = [*old.get("subset_runs", []), subset]
    return merged


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(doc: dict) -> str:
    """The Markdown page for the records in ``doc``."""
    from tests.distributed.test_fault_matrix import PENDING

    cases = doc["cases"]
    run = doc.get("run", {})
    counts: dict[str, int] = {}
    for c in cases:
        key = c["outcome"].split(":")[0]  # "known gap: why", "skipped: why" -> the kind
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no cases recorded"
    lines = [
        "# Reliability: the fault matrix",
        "",
        "What a job does when a rank, a user or a peer misbehaves. Every row is a test in",
        f"`{MODULE}` that starts real processes (mpirun, or gloo ranks with torchrun's",
        "environment), has a timeout, and checks that the job ends cleanly: the expected error,",
        "naming the rank, and nothing left running. *Time* is the wall time from the start of",
        "the job (for signals: from the signal) until every process had exited; it includes each",
        "rank's Python and torch start-up, which dominates on a small machine.",
        "",
        f"This page is generated by `{run.get('command', 'python -m tests.distributed.fault_report')}`"
        f" from `benchmarks/results/fault-matrix.json`.",
        "",
        f"**{len(cases)} cases: {summary}.**"
        + (
            f" Run {run['date']} on {run['machine']}, load average {run['load_average'][0]}-"
            f"{run['load_average'][1]}, {run['wall_s']} s in all."
            if "date" in run
            else ""
        ),
        "",
        *(
            [
                "Rows re-run since, merged into the same file: "
                + "; ".join(
                    f"`{r['command']}` ({r['date']}, load average {r['load_average'][0]}-"
                    f"{r['load_average'][1]}, {r['wall_s']} s)"
                    for r in doc.get("subset_runs", [])
                )
                + ".",
                "",
            ]
            if doc.get("subset_runs")
            else []
        ),
        "| Case | Transport | Ranks | Expected behaviour | Result | Time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        secs = "-" if c["seconds"] is None else f"{c['seconds']:.1f}"
        lines.append(
            f"| {_cell(c['case'])} | {_cell(c['transport'])} | {c['ranks']} | "
            f"{_cell(c['expected'])} | {_cell(c['outcome'])} | {secs} |"
        )
    if PENDING:
        lines += [
            "",
            "## Not yet in the matrix",
            "",
            "These join the matrix with their fixes (issue 15):",
            "",
            "| Case | Expected behaviour | Item |",
            "|---|---|---|",
        ]
        lines += [f"| {_cell(a)} | {_cell(b)} | {item} |" for a, b, item in PENDING]
    lines += checkpoint_section()
    lines += [
        "",
        "## Ranks that leave early, and uneven data",
        "",
        "A rank that leaves without an exception (its script returns, or calls",
        "`sys.exit`) while the others still train: under `mpi` every rank meets the others",
        "in a non-blocking barrier when it exits; at a normal end they all arrive and leave",
        "at once, and a rank left alone waits `COMMOPT_EXIT_TIMEOUT` seconds (default 30)",
        "for the others, then aborts the job naming itself. Under `torch` (gloo) the",
        "leaving rank notes why in the rendezvous store and its peers raise `CommError`",
        "naming it. Under `horovod` over MPI each rank, as it leaves, sends the others a",
        "notice on a private communicator. A peer reads the notices before it starts any",
        "Horovod operation and while it waits for one: it then starts none, raises",
        "`PeerLeftError` (a `CommError` and a `HorovodInternalError`) naming the rank that",
        "left, and tells every rank it stopped. The leaving rank shuts Horovod down (as",
        "Horovod does at exit) once every peer has stopped, never before: an operation",
        "started while Horovod's shutdown frees its queue either gets no result or freezes",
        "its rank (the starting thread holds the GIL and waits for Horovod's process-set",
        "lock, which the shutting-down thread holds while it frees tensors, which takes the",
        "GIL), and a frozen rank runs no Python to name anyone. Then the same exit barrier",
        "as under `mpi` ends a job whose other ranks do not leave. The window left open: a",
        "peer that neither starts nor waits for a Horovod operation within",
        "`COMMOPT_EXIT_TIMEOUT` (a long computation) is not waited for; if its next",
        "operation races the shutdown it may freeze, and the leaving rank's barrier aborts",
        "the job at that bound, naming itself. When shards are uneven by design, train inside",
        "`with commopt.Join(optimizer):` so that ranks that run out of data keep joining",
        "the others' steps with zero gradients (the average is over all ranks) until every",
        "rank is done.",
        "",
        "## Links that fail: the communication timeout",
        "",
        "Every collective's wait is bounded by one setting: `create_communicator(timeout=)`,",
        "else `COMMOPT_COMM_TIMEOUT` (seconds), else 600 s; `0` or `off` means no bound.",
        "`commopt launch` hands it, like every `COMMOPT_*` variable (and `TORCH_NCCL_*`,",
        "`HOROVOD_*`, `NCCL_*`), to every rank: mpirun gets `-x NAME` for each (ranks on other",
        "hosts see only what `-x` names), and the torch launcher's ranks inherit its",
        "environment. What restarts the clock differs by transport:",
        "",
        "- `mpi`: one clock per peer a collective waits for. On the pipelined path (between",
        "  nodes, buffers of at least 256 KiB) every segment (at most about 1 MiB) that arrives",
        "  from a peer, or leaves for it, restarts that peer's clock, so a slow link is not a",
        "  dead one: only a link that moves no segment for the whole timeout trips it. MPI's",
        "  own collectives (smaller buffers, one node, `barrier`, `broadcast`, the object",
        "  exchange) restart it only when they complete. When a clock runs out, a watchdog",
        "  thread prints `rank R: <collective> of N bytes made no progress for T s: nothing",
        "  from rank P (host) for X s`, waits a second (so peers whose clocks ran out too can",
        "  say so) and calls `MPI_Abort`; the process ends within 6 s",
        "  even if mpirun cannot be reached. In a ring a rank hears only from its neighbours:",
        "  the rank beside the failed link names the peer across it.",
        "- `torch` over gloo: the process group's timeout is the setting. gloo bounds the",
        "  waits inside its algorithms by it, but after a link went down silently gloo alone",
        "  still waited after 120 s in the link-down row below. So",
        "  commopt polls each gloo operation and raises `CommError` once this communicator",
        "  has seen no collective complete for the timeout, counted from the operation's",
        "  issue: progress is counted in whole collectives, and one collective slower than",
        "  the timeout trips it. gloo does not say which peer was silent; the error lists",
        "  the collective's peers. Uncaught, it ends the rank at once, and the peers' own",
        "  timeouts (or the closed connections) end them.",
        "- `torch` over nccl: the process group's timeout is the setting, and",
        "  `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` is set unless given: torch's watchdog aborts",
        "  a collective that runs longer and ends the process (whole collectives).",
        "- `pure_nccl`: every host wait (`Work.synchronize`, `barrier`, `finalize`) polls the",
        "  collective's CUDA event and NCCL's asynchronous error; an error, or no completion",
        "  within the timeout of the wait's start, calls `ncclCommAbort` and raises `CommError`",
        "  naming the collective (NCCL does not say which peer).",
        "- `horovod`: `HOROVOD_STALL_CHECK_TIME_SECONDS` (half the timeout, at most 60) and",
        "  `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS` (the timeout) unless given, and each",
        "  operation's wait raises `CommError` when it is not done a timeout after its issue.",
        "  Starting an operation can block too: with process sets (which `split` needs)",
        "  Horovod's background thread holds its process-set lock through an MPI exchange",
        "  every cycle, and the call that starts an operation waits for that lock while it",
        "  holds the GIL, so once a link is down every Python thread of the rank stops. Each",
        "  call that starts an operation (and `barrier`) therefore runs under a deadline",
        "  watched by a native thread (`commopt/comm/deadline.py`): a timeout later it prints",
        "  `rank R: Horovod's <operation> did not start within T s, waiting for rank(s) P`",
        "  and ends the process two seconds later (mpirun then ends the job). Once an",
        "  operation timed out, the rank starts no other (it would freeze before it reports).",
        "",
        "The rows on the emulated cluster (`commopt launch -n 2 --link 1gbit`, one rank per",
        "host; the emulated hosts share this machine's 2 cores) break host1's data link from",
        "inside its namespace mid-run: `ip link set data0 down` for good, or its `tbf` rate",
        "cut from 1 Gbit/s to 10 Mbit/s, with `COMMOPT_COMM_TIMEOUT=5`; down 2 s then up, or",
        "down 1 s and up 1 s three times, with `COMMOPT_COMM_TIMEOUT=60`. Runs that survive",
        "an outage are compared with a run without it: the final weights' digests must be",
        "equal. " + _outage_silence() + " `horovod` runs over",
        "mpirun (`--launcher mpi`); it has no slow-link rows: its clock counts from an",
        "operation's issue, so one operation slower than the timeout would trip it. The GPU",
        "transports have no rows here: this machine has no GPU.",
        "",
        "Known gaps are cases the transport does not meet yet; their tests are marked",
        "as expected failures, and fail the suite once the gap is closed, so the mark is",
        "removed with the fix.",
        "",
    ]
    return "\n".join(lines)


OUTAGE_JSON = REPO / "benchmarks" / "results" / "outage-silence.json"


def _outage_silence() -> str:
    """What benchmarks/outage_silence.py measured: how long a link that came back left the
    transports silent, the reason the rows that survive an outage run with a longer timeout."""
    if not OUTAGE_JSON.exists():
        return ""
    rec = json.loads(OUTAGE_JSON.read_text())
    worst = {k: v["max_s"] for k, v in rec["summary"].items()}
    runs = {v["runs"] for v in rec["summary"].values()}
    loads = [r["load_average_1m"] for r in rec["runs"]]
    return (
        "A link that comes back can leave the transport silent far longer than the outage"
        " (TCP backs its retransmission timer off while the link is down; the `mpi` transport,"
        " over Open MPI's TCP layer, resumed later than gloo): the longest"
        " step around the outage, over "
        + "/".join(str(n) for n in sorted(runs))
        + " runs each, was "
        + ", ".join(f"{s:.1f} s ({k})" for k, s in sorted(worst.items()))
        + f" (load average {min(loads):.0f}-{max(loads):.0f}; `{rec['command']}`,"
        " `benchmarks/results/outage-silence.json`). Set the timeout well above the longest"
        " outage a job should ride out."
    )


KILL_JSON = REPO / "benchmarks" / "results" / "kill-during-save.json"


def checkpoint_section(path: Path = KILL_JSON) -> list[str]:
    """The page's section on checkpoints and restarts, its figures from ``path``."""
    lines = [
        "",
        "## Checkpoints and restarts",
        "",
        "`commopt.optim.save_checkpoint` (and `commopt.checkpointing.CheckpointManager`,",
        "which numbers checkpoints under one folder) writes a checkpoint under a staging name",
        "beside it (`.NAME.partial`), each rank its own part. Every file and folder is",
        "fsynced; each rank sends the size and SHA-256 of its files to rank 0 through the",
        "communicator, and rank 0 writes `MANIFEST.json` and renames the folder into place",
        "only once every rank's part is on disk. A checkpoint replaced at the same path moves",
        "aside (`.NAME.old`) for the moment between the two renames, where the loader finds",
        "it. The manager then points `latest` at the new checkpoint (a temporary file,",
        "fsynced, renamed over the old pointer) and keeps the last `keep`.",
        "",
        "Loading checks every file it reads against the manifest before restoring anything:",
        "a missing, truncated or altered file raises `CheckpointError` naming the file and",
        "what is wrong (`.../rank1/__0_0.distcp is truncated: 1200 bytes on disk, the",
        "manifest says 2400`); a damaged `latest` is an error, not a fresh start",
        "(`tests/unit/test_checkpointing.py`).",
    ]
    if path.exists():
        doc = json.loads(path.read_text())
        s = doc["summary"]
        lines += [
            "",
            f"**SIGKILL during a save: {s['trials']} trials, {s['loadable']} loadable previous "
            f"checkpoints, {s['wrong_resumes']} wrong resumes.** {doc['ranks']} gloo ranks save "
            "a checkpoint after every step, back to back (an MLP with `qsgd4+ef`, so every",
            "rank has residuals of its own); after a random delay one random rank is",
            "SIGKILLed and the other a few milliseconds later; new ranks resume with",
            "`load_latest` and compare what they restored, on every rank, with a digest",
            "recorded before that step's save. A wrong resume is a restored state that differs",
            "from the digest, or a step older than the last save a rank saw complete. "
            f"{s['killed_mid_write']} kills left a staging folder (killed while writing); "
            f"{s['resumed_newer_than_seen']} resumed from a save that had completed but not yet",
            f"returned; {s['killed_between_renames']} landed between the two renames (that",
            "state is made by hand in the unit tests). "
            f"`{doc['command']}`, {doc['date']}, {doc['machine']}, shared with other jobs "
            f"(load average {doc['load_average'][0]}), {doc['wall_s']} s; "
            "`tests/distributed/test_kill_during_save.py` runs 3 trials.",
        ]
    lines += [
        "",
        "Resuming with another number of ranks restores the replicated part (model,",
        "optimizer, counters, double buffering's pending averaged gradients). Error-feedback",
        "residuals are each rank's, kept per chunk of its reduce-scatter, which another number",
        "of ranks cuts differently; only their sum over the ranks enters the mean, so by default",
        '(`residuals="reshard"`) each bucket\'s residuals are summed over the saved ranks, element',
        "by element, and handed to the new ranks (the native plan: a share on every rank; the",
        "scatter-reduce plan: each chunk's sum to its owner). Residuals of the hierarchical plan,",
        "whose chunks depend on the node layout, and a low-rank codec's state are dropped, and",
        'rank 0 logs which buckets restart at zero and why. `residuals="refuse"` raises instead,',
        'naming both counts; `residuals="drop"` restarts them all at zero. Compensated double',
        "buffering saved between steps (each rank's predicted weights) resumes only with the same",
        "number of ranks (`tests/distributed/test_checkpoint_reshard.py`).",
        "",
        "**Elastic restart.** Under `torchrun --max-restarts N`, or `mpirun` in a loop (a",
        "scheduler's requeue), a script that calls `CheckpointManager.load_latest` at the top",
        "and keeps its sampler's position in the checkpoint's `extra` resumes where the last",
        "complete checkpoint left it (`commopt/examples/elastic_train.py`).",
        "`tests/distributed/test_elastic_restart.py` kills rank 1 after step 7 of 12",
        "(checkpoints every 5, two epochs of a shuffling DistributedSampler) and restarts",
        "the job: for no codec, fp16, bf16, qsgd4+ef, qsgd4+ef with double buffering, fp16",
        "with compensated double buffering, a mixed per-group plan (the first layer",
        "synchronous, the rest compensated qsgd4+ef) and the low-rank powersgd4 (its warm-start",
        "`Q` and residual are per-rank state: plain, with double buffering, and",
        "`powersgd4-start6`, whose warm-up ends after the restart) under torchrun, and qsgd4+ef",
        "with double buffering, fp16 with compensated double buffering, the mixed plan and",
        "powersgd4 with double buffering under an mpirun requeue, the final weights are",
        "bit-identical to the same runs never interrupted.",
    ]
    return lines


def kept_sections(path: Path) -> str:
    """The sections other generators own (``<!-- name: begin -->`` ... ``<!-- name: end -->``:
    the soak and fuzz benchmarks'), kept as they are in ``path`` when the matrix rewrites it."""
    if not path.exists():
        return ""
    found = re.findall(
        r"(<!-- (\w+): begin -->.*?<!-- \2: end -->\n?)", path.read_text(), flags=re.S
    )
    return "".join("\n" + block for block, _ in found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-json", type=Path, help="render this record file; run nothing")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help="where the run's records go"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the page to write")
    parser.add_argument(
        "--only",
        metavar="PATTERN",
        help="run the cases pytest -k PATTERN selects and merge them into --json",
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
    elif args.only:
        if not args.json.exists():
            parser.error(f"--only merges into {args.json}, which does not exist: run all first")
        old = json.loads(args.json.read_text())
        part = args.json.with_name(args.json.stem + ".subset.json")
        try:
            new = run_matrix(part, ["-k", args.only, *args.pytest_args])
        finally:
            part.unlink(missing_ok=True)
        new["run"]["command"] = "python -m tests.distributed.fault_report --only " + " ".join(
            map(shlex.quote, [args.only, *args.pytest_args])
        )
        doc = merge(old, new, args.only)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    else:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = run_matrix(args.json, args.pytest_args)
    args.out.write_text(render(doc) + kept_sections(args.out))
    print(f"wrote {args.out} ({len(doc['cases'])} cases)")
    failed = [c for c in doc["cases"] if c["outcome"] == "failed"]
    codes = [
        r.get("pytest_exit_code", 0) for r in [doc.get("run", {}), *doc.get("subset_runs", [])]
    ]
    return 1 if failed or any(codes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
