"""The failures of ``scripts/stress.sh``'s runs, per test: how often, in which runs, and each
failure's text (with every rank's stacks where a job hung).

    python scripts/stress_report.py out/stress      # reads out/stress/run-*.xml (JUnit)

Exits 1 when a test failed (or errored) in any run, or a run wrote no result.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read_run(path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """(counts of passed/failed/skipped tests, {failed test id: its failure text})."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
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
    return counts, failures


def _run_number(path: Path) -> int:
    found = re.search(r"(\d+)", path.stem)
    return int(found.group(1)) if found else 0


def main(directory: str) -> int:
    runs = sorted(Path(directory).glob("run-*.xml"), key=_run_number)
    logs = sorted(Path(directory).glob("run-*.log"), key=_run_number)
    missing = [p for p in logs if not p.with_suffix(".xml").exists()]
    failed: dict[str, list[tuple[int, str]]] = {}
    for path in runs:
        counts, failures = read_run(path)
        print(f"run {_run_number(path)}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        for test, text in failures.items():
            failed.setdefault(test, []).append((_run_number(path), text))
    for path in missing:
        print(f"run {_run_number(path)}: no result (pytest did not finish): see {path}")
    if not failed:
        print(
            f"{len(runs)} runs, no failure"
            + (f"; {len(missing)} without a result" if missing else "")
        )
        return 1 if missing or not runs else 0
    print(f"\n{len(failed)} tests failed in {len(runs)} runs:")
    for test, where in sorted(failed.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(where)}x {test} (runs {', '.join(str(r) for r, _ in where)})")
    for test, where in failed.items():
        for run, text in where:
            print(f"\n===== {test}, run {run} =====\n{text}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out/stress"))
