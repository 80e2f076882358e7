"""scripts/stress_report.py: each run's JUnit file read into a record, and batches of runs
recorded at different times rendered together, per test file by its weakest case."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stress_report.py"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("stress_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _junit(path: Path, cases: dict[str, str]) -> None:
    """A JUnit file with one testcase per ``"file::name": outcome`` (pass, fail, skip)."""
    body = []
    for test, outcome in cases.items():
        module, name = test.split("::")
        inner = {"pass": "", "fail": '<failure message="boom">rank 1 hung</failure>'}.get(
            outcome, '<skipped message="no mpi"/>'
        )
        body.append(f'<testcase classname="{module}" name="{name}" time="1.5">{inner}</testcase>')
    path.write_text(f"<testsuites><testsuite>{''.join(body)}</testsuite></testsuites>")


def _batch(directory: Path, runs: list[dict[str, str]]) -> None:
    directory.mkdir()
    lines = []
    for i, cases in enumerate(runs, 1):
        _junit(directory / f"run-{i}.xml", cases)
        (directory / f"run-{i}.log").write_text("")
        lines.append(f"{i}\t0\t10\t3.0 2.0 1.0")
    (directory / "runs.tsv").write_text("\n".join(lines) + "\n")
    (directory / "args.txt").write_text("tests/distributed/test_a.py\n")


def test_a_record_counts_each_cases_passing_runs_and_names_the_failed_run(report, tmp_path):
    a, b = "tests.distributed.test_a::test_one", "tests.distributed.test_a::test_two"
    _batch(tmp_path / "s", [{a: "pass", b: "pass"}, {a: "pass", b: "fail"}])
    record, texts = report.collect(tmp_path / "s")
    assert record["passes"] == {a: 2, b: 1}
    assert record["failures"] == {b: [2]}
    assert texts[b][0][0] == 2 and "rank 1 hung" in texts[b][0][1]
    text, ok = report.summary(record, texts)
    assert not ok and "1x " + b in text


def test_batches_render_together_per_file_by_the_weakest_case(report, tmp_path):
    a, b = "tests.distributed.test_a::test_one", "tests.distributed.test_a::test_two"
    c = "tests.distributed.test_c::test_three"
    _batch(tmp_path / "s1", [{a: "pass", b: "pass"}] * 3)
    _batch(tmp_path / "s2", [{a: "pass", b: "skip", c: "pass"}] * 2)
    records = []
    for name in ("s1", "s2"):
        record, _ = report.collect(tmp_path / name)
        record.update(command=f"N=? bash scripts/stress.sh ({name})", started="today")
        if name == "s2":
            record.update(commit="abc1234", tests=[])  # a record of the default set
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(record))
        records.append((json.loads(path.read_text()), str(path)))
    text = report.section(records)
    assert text.count("N=? bash scripts/stress.sh") == 2
    assert "(s2)` on today at commit `abc1234`: the default set of scripts/stress.sh," in text
    assert "(s1)` on today: `tests/distributed/test_a.py`," in text
    assert "| `tests.distributed.test_a` | 2 | 3 | 0 |" in text  # b passed 3 runs (s2 skipped it)
    assert "| `tests.distributed.test_c` | 1 | 2 | 0 |" in text
    page = tmp_path / "reliability.md"
    page.write_text("# Reliability\n\nabove\n")
    report.write_section(page, text)
    report.write_section(page, text)  # a second write replaces the section
    assert page.read_text().count(report.BEGIN) == 1 and "above" in page.read_text()
