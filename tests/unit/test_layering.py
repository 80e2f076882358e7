"""The layers of commopt, checked: a package imports only the layers below it.

Every ``import`` in ``commopt/`` (at module level or inside a function: a lazy import is still
a dependency) is read from the source, so nothing is imported to check it. A package imports
its own modules freely and the packages of lower layers; a new top-level package or module
goes into :data:`LAYERS` where docs/design.md puts it. Private names (``_x``) are not imported
across packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "commopt"

#: Top to bottom. Packages in one layer may import each other.
LAYERS: list[tuple[str, set[str]]] = [
    ("the package's public surface", {"__init__"}),
    ("entry points", {"__main__", "cli"}),
    ("commands, benchmarks and checks", {"commands", "bench", "examples", "gpu_check"}),
    ("the scaling simulator", {"sim"}),
    ("network set-up tools", {"network"}),
    ("the emulated cluster", {"testbed"}),
    ("framework integrations", {"integrations"}),
    ("end-of-data handling", {"join"}),
    ("the optimizer wrapper and its checkpoints", {"optim", "checkpointing"}),
    ("the reducer (buckets of gradients)", {"reducer"}),
    ("allreduce algorithms", {"collectives"}),
    ("the asynchrony driver", {"driver"}),
    ("codecs", {"codecs"}),
    ("codec kernels", {"kernels"}),
    ("transports", {"comm"}),
    ("shared utilities", {"tables", "units", "memory", "profiling", "native_libraries"}),
]
LEVEL = {name: level for level, (_, names) in enumerate(LAYERS) for name in names}


def _imports(path: Path):
    """(line, imported module, imported names) of every absolute import of commopt."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            if node.module == "commopt":  # from commopt import kernels, sim
                for name in names:
                    yield node.lineno, f"commopt.{name}", []
            else:
                yield node.lineno, node.module, names


def _package(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        src = _package(path, root)
        where = path.relative_to(root.parent)
        if src not in LEVEL:
            out.append(f"{where}: package {src!r} is in no layer: add it to LAYERS")
            continue
        for line, module, names in _imports(path):
            parts = module.split(".")
            if parts[0] != "commopt" or len(parts) < 2 or parts[1] == src:
                continue
            dst = parts[1]
            if dst not in LEVEL:
                out.append(f"{where}:{line}: imports {module}, which is in no layer")
            elif LEVEL[dst] < LEVEL[src]:
                out.append(
                    f"{where}:{line}: {LAYERS[LEVEL[src]][0]} ({src}) imports {module}, a "
                    f"layer above it ({LAYERS[LEVEL[dst]][0]})"
                )
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                out.append(f"{where}:{line}: imports private names {private} from {module}")
    return out


def test_every_import_goes_down_the_layers():
    found = violations()
    assert not found, "layering (see CONTRIBUTING.md, 'The layers'):\n" + "\n".join(found)


def test_the_check_finds_an_upward_import(tmp_path):
    pkg = tmp_path / "commopt"
    (pkg / "codecs").mkdir(parents=True)
    (pkg / "codecs" / "bad.py").write_text(
        "def f():\n    from commopt.optim.multi_node import _private\n"
    )
    found = violations(pkg)
    assert len(found) == 2 and "a layer above it" in found[0] and "_private" in found[1], found
