"""docs/reliability.md is made from the fault matrix's records alone."""

from tests.distributed.fault_report import render


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
