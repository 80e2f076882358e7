"""docs/reliability.md is made from the fault matrix's records alone."""

from tests.distributed.fault_report import merge, render


def test_page_counts_and_times_come_from_the_records(monkeypatch):
    import tests.distributed.test_fault_matrix as matrix

    monkeypatch.setattr(matrix, "PENDING", [("a case", "what it should do", "15.9")])
    doc = {
        "cases": [
            {
                "case": "a rank raises",
                "transport": "mpi",
                "ranks": 2,
                "expected": "ends",
                "outcome": "passed",
                "seconds": 5.25,
                "test": "t1",
            },
            {
                "case": "a | pipe",
                "transport": "torch",
                "ranks": 4,
                "expected": "x",
                "outcome": "failed",
                "seconds": None,
                "test": "t2",
            },
            {
                "case": "gap",
                "transport": "mpi",
                "ranks": 2,
                "expected": "y",
                "outcome": "known gap: pickles",
                "seconds": 1.0,
                "test": "t3",
            },
        ],
        "run": {
            "command": "python -m tests.distributed.fault_report",
            "date": "2026-01-01 00:00 UTC",
            "machine": "x86_64, 2 cores",
            "load_average": [1.0, 2.0],
            "wall_s": 9.0,
        },
    }
    page = render(doc)
    assert "**3 cases: 1 failed, 1 known gap, 1 passed.**" in page
    assert "| a rank raises | mpi | 2 | ends | passed | 5.2 |" in page
    assert "a \\| pipe" in page and "| failed | - |" in page
    assert "Not yet in the matrix" in page and "15.9" in page
    monkeypatch.setattr(matrix, "PENDING", [])
    assert "Not yet in the matrix" not in render(doc)


# -- --only: a subset run merged into the full run's record file, by test id
M = "tests/distributed/test_fault_matrix.py::"


def row(test: str, case: str, seconds: float = 1.0) -> dict:
    return {
        "case": case,
        "transport": "mpi",
        "ranks": 2,
        "expected": "-",
        "outcome": "passed",
        "seconds": seconds,
        "test": M + test,
    }


RUN = {"command": "c", "date": "d", "load_average": [1.0, 2.0], "wall_s": 3.0, "machine": "m"}


def test_rows_of_a_rerun_test_are_replaced_and_new_tests_go_beside_their_siblings():
    old = {
        "run": RUN,
        "cases": [
            row("test_a[mpi]", "a"),
            row("test_two_rows", "first"),
            row("test_two_rows", "second"),
            row("test_leaves[mpi]", "leaves"),
            row("test_z", "z"),
        ],
    }
    new = {
        "run": dict(RUN, command="subset", pytest_exit_code=0),
        "cases": [row("test_leaves[mpi]", "leaves again", 9.0), row("test_leaves[hvd]", "hvd")],
    }
    merged = merge(old, new, "leaves", ["test_a", "test_two_rows", "test_leaves", "test_z"])
    assert [c["case"] for c in merged["cases"]] == [
        "a",
        "first",
        "second",
        "leaves again",
        "hvd",
        "z",
    ]
    assert merged["run"] == RUN and merged["subset_runs"][0]["only"] == "leaves"
    assert old["cases"][3]["case"] == "leaves"  # the input is not modified
    page = render(merged)
    assert "**6 cases: 6 passed.**" in page and "`subset` (d, load average 1.0-2.0" in page


def test_a_test_that_now_records_two_rows_replaces_its_one():
    old = {"run": RUN, "cases": [row("test_t", "one"), row("test_u", "u")]}
    new = {"run": RUN, "cases": [row("test_t", "one'"), row("test_t", "two")]}
    assert [c["case"] for c in merge(old, new, "t", ["test_t", "test_u"])["cases"]] == [
        "one'",
        "two",
        "u",
    ]


def test_a_new_test_function_goes_where_the_module_defines_it():
    old = {"run": RUN, "cases": [row("test_a", "a"), row("test_c", "c")]}
    new = {"run": RUN, "cases": [row("test_b", "b")]}
    order = ["test_a", "test_b", "test_c"]
    assert [c["case"] for c in merge(old, new, "b", order)["cases"]] == ["a", "b", "c"]
