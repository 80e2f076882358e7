"""benchmarks/ and recipes/ use commopt's public API only: no module or name starting with "_"."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def private_imports(path: Path) -> list[str]:
    """``commopt`` imports of ``path`` that name a private module or a private name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "commopt":
            parts = node.module.split(".")
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            hits = [a.name for a in node.names if a.name.split(".")[0] == "commopt"]
            if not hits:
                continue
            parts, names = [p for h in hits for p in h.split(".")], []
        else:
            continue
        if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_finder_sees_a_private_import(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    script = tmp_path / "s.py"
    script.write_text("from commopt.optim._wrapping import x\nimport commopt.tables\n")
    assert private_imports(script) == ["s.py:1"]


def test_benchmarks_and_recipes_import_no_private_commopt_name():
    scripts = sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "recipes").rglob("*.py"))
    assert len(scripts) > 20
    found = [hit for s in scripts for hit in private_imports(s)]
    assert not found, f"private commopt imports (use the public API): {found}"
