"""Import the scripts under benchmarks/ (not a package) by path, once per test session."""
from __future__ import annotations

from pathlib import Path

from commopt._importing import import_file

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module, registered in sys.modules under ``name``.

    Registered before it runs, so dataclasses and doctests inside it resolve their module;
    a second call returns the same module.
    """
    return import_file(name, BENCHMARKS / f"{name}.py")
