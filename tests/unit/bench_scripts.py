"""Import the scripts under benchmarks/ (not a package) by path, once per test session.

The step benchmark is in the package (commopt.bench.step); the scripts that stay under
benchmarks/ are imported here by path, for their tests only.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module, registered in sys.modules under ``name``.

    Registered before it runs, so dataclasses and doctests inside it resolve their module;
    a second call returns the same module.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
