"""docs/design.md describes the code as it is: every file or folder it names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
# Where a relative name in design.md may live (it names commopt's modules without "commopt/").
BASES = [ROOT, ROOT / "commopt"]
SEARCHED = ["commopt", "commopt_ext", "recipes", "tests", "benchmarks", "scripts", "docs"]
PATH = re.compile(r"(?<![\w./-])([\w.-]+(?:/[\w.-]+)*/?)(?![\w/-])")


def named_paths(text: str) -> set[str]:
    """Words that name a file (``x.py``, ``a/b.cpp``) or a folder (``comm/mpi/``)."""
    names = set()
    for word in PATH.findall(text):
        word = word.rstrip(".")
        if re.search(r"\w\.(py|cpp|md|toml|sh|json)$", word) or (
            word.endswith("/") and len(word) > 1
        ):
            names.add(word)
    return names


def exists(name: str) -> bool:
    if any((base / name).exists() for base in BASES):
        return True
    if "/" in name.rstrip("/"):
        return False  # a path with folders must be found from the root or commopt/
    return any(next((ROOT / top).rglob(name.rstrip("/")), None) for top in SEARCHED)


def test_every_path_design_md_names_exists():
    names = named_paths(DESIGN.read_text())
    assert len(names) > 40, sorted(names)  # the check reads the paths, not nothing
    missing = sorted(n for n in names if not exists(n))
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"


def test_the_check_finds_a_missing_path():
    assert not exists("kernels/cuda.py") and exists("kernels/triton.py")
    assert named_paths("see `commopt/kernels/cuda.py` and step/") == {
        "commopt/kernels/cuda.py",
        "step/",
    }
