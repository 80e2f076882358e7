"""Collection rules for the whole tree (pytest's root conftest).

``--doctest-modules`` imports every module under the test paths to find its examples. Under
tests/ only the test modules (and conftests) may be imported that way: the other files there are
helpers and rank scripts that mpirun starts, and a rank script runs its rank at import.
"""

from __future__ import annotations

from pathlib import Path

_TESTS = Path(__file__).resolve().parent / "tests"


def pytest_ignore_collect(collection_path: Path, config: object) -> bool | None:
    if collection_path.suffix != ".py" or _TESTS not in collection_path.parents:
        return None  # pytest decides
    name = collection_path.name
    if name.startswith("test_") or name in ("conftest.py", "__init__.py"):
        return None
    return True
