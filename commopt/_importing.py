"""Import a Python file that belongs to no package (the scripts under ``benchmarks/``).

    >>> import tempfile, pathlib
    >>> from commopt._importing import import_file
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "answer.py"
    >>> _ = path.write_text("VALUE = 42\\n")
    >>> import_file("commopt_doctest_answer", path).VALUE
    42
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(name: str, path: str | Path) -> ModuleType:
    """The file at ``path`` as a module registered in ``sys.modules`` under ``name``.

    Registered before it runs, so the dataclasses and doctests inside it resolve their
    module; a second call with the same name returns the module already loaded.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
