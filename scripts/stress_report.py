"""The failures of ``scripts/stress.sh``'s runs, per test: how often, in which runs, and each
failure's text (with every rank's stacks where a job hung); its record, and the section of
docs/reliability.md made from that record.

    python scripts/stress_report.py out/stress --json out/stress/stress.json
    python scripts/stress_report.py --from-json benchmarks/results/stress.json --docs docs/reliability.md

Reads ``run-*.xml`` (JUnit), ``runs.tsv`` and ``args.txt`` of a stress directory; the command,
start, hog and commit come from $STRESS_COMMAND, $STRESS_STARTED, $STRESS_HOG, $STRESS_WORKERS
and $STRESS_COMMIT (stress.sh sets them). Exits 1 when a test failed (or errored) in any run, or a run wrote no
result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: The Horovod cases in which a rank leaves early (the departure race): reported on their own.
LEAVE_EARLY = re.compile(r"test_a_rank_that_leaves_early_ends_the_job\[horovod-")
BEGIN, END = "<!-- stress: begin -->", "<!-- stress: end -->"


def read_run(
    path: Path,
) -> tuple[dict[str, int], dict[str, str], dict[str, float], set[str]]:
    """(counts of passed/failed/skipped tests, {failed test: its failure text}, {test: s},
    the tests that passed)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    passed: set[str] = set()
    failures: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        seconds[test] = float(case.get("time", "0") or 0)
        bad = [c for c in case if c.tag in ("failure", "error")]
        if bad:
            counts["failed"] += 1
            failures[test] = "\n".join(
                f"[{c.tag}] {c.get('message', '')}\n{c.text or ''}".rstrip() for c in bad
            )
        elif any(c.tag == "skipped" for c in case):
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
            passed.add(test)
    return counts, failures, seconds, passed


def _run_number(path: Path) -> int:
    found = re.search(r"(\d+)", path.stem)
    return int(found.group(1)) if found else 0


def collect(directory: Path) -> tuple[dict, dict[str, list[tuple[int, str]]]]:
    """The record of a stress directory, and every failure's text by test."""
    tsv = directory / "runs.tsv"
    walls = {}
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        run, rc, took, load = line.split("\t")
        walls[int(run)] = {"exit": int(rc), "seconds": int(took), "load_average": load}
    args = (
        (directory / "args.txt").read_text().split("\n")
        if (directory / "args.txt").exists()
        else []
    )
    record: dict = {
        "command": os.environ.get("STRESS_COMMAND", ""),
        "started": os.environ.get("STRESS_STARTED", ""),
        "hog_processes": int(os.environ.get("STRESS_HOG", "0") or 0),
        "workers": os.environ.get("STRESS_WORKERS", ""),
        "commit": os.environ.get("STRESS_COMMIT", ""),
        "tests": [a for a in args if a],
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "runs": [],
        "failures": {},
        "passes": {},
        "leave_early": {"runs_passed": 0, "cases": 0, "max_seconds": 0.0},
    }
    texts: dict[str, list[tuple[int, str]]] = {}
    logs = sorted(directory.glob("run-*.log"), key=_run_number)
    for log in logs:
        run = _run_number(log)
        xml = log.with_suffix(".xml")
        entry = {"run": run, **walls.get(run, {})}
        if not xml.exists():
            entry["result"] = "no result (pytest did not finish)"
            record["runs"].append(entry)
            continue
        counts, failures, seconds, passed = read_run(xml)
        entry.update(counts)
        record["runs"].append(entry)
        for test in passed:
            record["passes"][test] = record["passes"].get(test, 0) + 1
        for test, text in failures.items():
            texts.setdefault(test, []).append((run, text))
            record["failures"].setdefault(test, []).append(run)
        leave = {t: s for t, s in seconds.items() if LEAVE_EARLY.search(t)}
        if leave and not any(LEAVE_EARLY.search(t) for t in failures):
            record["leave_early"]["runs_passed"] += 1
        record["leave_early"]["cases"] = max(record["leave_early"]["cases"], len(leave))
        record["leave_early"]["max_seconds"] = max(
            [record["leave_early"]["max_seconds"], *leave.values()]
        )
    return record, texts


def summary(record: dict, texts: dict[str, list[tuple[int, str]]]) -> tuple[str, bool]:
    lines = []
    for r in record["runs"]:
        what = r.get("result") or ", ".join(f"{r[k]} {k}" for k in ("passed", "failed", "skipped"))
        lines.append(f"run {r['run']}: {what}")
    missing = [r for r in record["runs"] if "result" in r]
    ok = bool(record["runs"]) and not record["failures"] and not missing
    if not record["failures"]:
        lines.append(f"{len(record['runs'])} runs, no failure")
    else:
        lines.append(f"\n{len(record['failures'])} tests failed in {len(record['runs'])} runs:")
        for test, runs in sorted(record["failures"].items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  {len(runs)}x {test} (runs {', '.join(map(str, runs))})")
        for test, where in texts.items():
            for run, text in where:
                lines.append(f"\n===== {test}, run {run} =====\n{text}")
    return "\n".join(lines), ok


def section(records: list[tuple[dict, str]]) -> str:
    """The stress section of docs/reliability.md, from records alone (each with its result
    file): one part per batch of runs, then, for more than one, each test file's runs in all."""
    out = [BEGIN, "## Stress: the multi-rank tests, again and again, under load", ""]
    for record, result_file in records:
        out += batch(record, result_file)
    if len(records) > 1:
        out += totals([r for r, _ in records])
    out.append(END)
    return "\n".join(out) + "\n"


def batch(record: dict, result_file: str) -> list[str]:
    """One batch of runs: its command, load, runs and failures."""
    runs = record["runs"]
    finished = [r for r in runs if "result" not in r]
    passed = sum(r["passed"] for r in finished)
    failed = sum(r["failed"] for r in finished)
    loads = [float(r["load_average"].split()[0]) for r in runs if r.get("load_average")]
    walls = [r["seconds"] for r in runs if "seconds" in r]
    hog = (
        f"a busy process on each of the {record['hog_processes']} cores"
        if record["hog_processes"]
        else "no hog"
    )
    tests = ", ".join(f"`{t}`" for t in record["tests"]) or "the default set of scripts/stress.sh"
    commit = f" at commit `{record['commit']}`" if record.get("commit") else ""
    out = [
        f"`{record['command']}` on {record['started']}{commit}: {tests}, "
        f"each run as CI runs the suite (`pytest {record['workers']}`), with {hog} for the whole "
        f"time, on one {record['machine']} host of {record['cores']} cores shared with other work "
        f"(load average at the end of each run {min(loads, default='?')}-{max(loads, default='?')}), "
        f"Python {record['python']}; {sum(walls)} s in all. Result file: `{result_file}`.",
        "",
        f"**{len(runs)} runs: {passed} test cases passed, {failed} failed"
        + (
            f", {len(runs) - len(finished)} runs without a result"
            if len(finished) < len(runs)
            else ""
        )
        + ".**",
        "",
        "| run | passed | failed | skipped | wall (s) | load average (1, 5, 15 min) |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "result" in r:
            out.append(
                f"| {r['run']} | {r['result']} | | | {r.get('seconds', '')} | {r.get('load_average', '')} |"
            )
        else:
            out.append(
                f"| {r['run']} | {r['passed']} | {r['failed']} | {r['skipped']} | "
                f"{r.get('seconds', '')} | {r.get('load_average', '')} |"
            )
    if record["failures"]:
        out += ["", "Failed:"]
        out += [
            f"- `{t}`: runs {', '.join(map(str, rs))}"
            for t, rs in sorted(record["failures"].items())
        ]
    le = record["leave_early"]
    if le["cases"]:
        out += [
            "",
            f"The Horovod cases in which rank 1 leaves early ({le['cases']}: `sys.exit(1)`, "
            f"`sys.exit(0)`, an early return, and `sys.exit(1)` on 4 ranks; each checks that "
            f"every other rank names rank 1 and that the job ends within 60 s of the departure) "
            f"passed in {le['runs_passed']} of {len(runs)} runs; the longest took "
            f"{le['max_seconds']:.1f} s from its start (start-up included, on the loaded cores).",
        ]
    out.append("")
    return out


def totals(records: list[dict]) -> list[str]:
    """Each test file's cases and how often each ran and passed over every batch: the fewest
    passing runs of any of its cases (a file's figure is its weakest case's)."""
    passes: dict[str, dict[str, int]] = {}
    failures: dict[str, int] = {}
    for record in records:
        for test, count in record.get("passes", {}).items():
            cases = passes.setdefault(test.split("::")[0], {})
            cases[test] = cases.get(test, 0) + count
        for test, runs in record["failures"].items():
            name = test.split("::")[0]
            passes.setdefault(name, {}).setdefault(test, 0)
            failures[name] = failures.get(name, 0) + len(runs)
    out = [
        "All batches together, per test file (a case's runs are counted where it passed; "
        "**fewest** is the least any case of the file passed):",
        "",
        "| test file | cases stressed | fewest passing runs of a case | failures |",
        "|---|---|---|---|",
    ]
    for name in sorted(passes):
        cases = passes[name]
        out.append(f"| `{name}` | {len(cases)} | {min(cases.values())} | {failures.get(name, 0)} |")
    out.append("")
    return out


def write_section(page: Path, text: str) -> None:
    doc = page.read_text()
    if BEGIN in doc:
        doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) + 1 :]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    page.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="out/stress")
    parser.add_argument("--json", help="write the record here")
    parser.add_argument(
        "--from-json",
        action="append",
        help="read this record instead of a directory (again: another batch, in order)",
    )
    parser.add_argument("--docs", help="write the stress section of this page (reliability.md)")
    args = parser.parse_args(argv)
    if args.from_json:
        records = [(json.loads(Path(f).read_text()), f) for f in args.from_json]
        texts: dict[str, list[tuple[int, str]]] = {}
    else:
        record, texts = collect(Path(args.directory))
        records = [(record, args.json or "")]
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    ok = True
    for record, _ in records:
        text, fine = summary(record, texts)
        print(text)
        ok = ok and fine
    if args.docs:
        write_section(Path(args.docs), section(records))
        print(f"wrote the stress section of {args.docs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
