"""Where the optional native libraries of ``commopt_ext`` are, when they were built.

``setup.py`` builds them beside the package (``build_ext --inplace`` in a checkout, or into
the installed ``commopt_ext``); a checkout or install without a C++ compiler has none, and
each user falls back to its pure-Python path.

    >>> find_extension("no_such_library") is None
    True
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path


def find_extension(stem: str) -> Path | None:
    """The path of ``commopt_ext/<stem><extension suffix>``, or None where it is not built."""
    spec = importlib.util.find_spec("commopt_ext")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(folder) / f"{stem}{suffix}"
            if path.exists():
                return path
    return None
