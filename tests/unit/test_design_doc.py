"""docs/design.md describes the code as it is: every file or folder it names exists, and its
glossary holds in the code (every class and key it names exists; no identifier uses a word in a
meaning the glossary gives another word)."""

import ast
import re
from pathlib import Path

import pytest

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


# -- the glossary ("Words"): one meaning per word, held in the code ----------------------------
COMMOPT = ROOT / "commopt"
WORDS = DESIGN.read_text().split("## Words", 1)[1].split("\n## ", 1)[0]
#: Names the glossary gives that are not commopt's own (torch's, a constant, an env).
EXTERNAL = {"GradBucket"}


def _modules(*roots: str) -> list[tuple[Path, ast.Module]]:
    files = []
    for root in roots:
        path = ROOT / root
        found = sorted([path] if path.is_file() else path.rglob("*.py"))
        files += [(f, ast.parse(f.read_text(), filename=str(f))) for f in found]
    return files


def _defined_names() -> set[str]:
    """Every class, function and module-level constant commopt defines."""
    names = set()
    for _, tree in _modules("commopt"):
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _string_constants() -> set[str]:
    return {
        node.value
        for _, tree in _modules("commopt")
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def _identifiers(tree: ast.Module) -> list[tuple[str, int]]:
    """The names a module binds: arguments, variables, attributes, fields, keywords, defs."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.arg):
            out.append((n.arg, n.lineno))
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.append((n.id, n.lineno))
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.append((n.attr, n.lineno))
        elif isinstance(n, ast.keyword) and n.arg:
            out.append((n.arg, n.lineno))
        elif isinstance(n, (ast.ClassDef, ast.FunctionDef)):
            out.append((n.name, n.lineno))
    return out


def test_every_class_and_key_the_glossary_names_exists():
    classes = set(re.findall(r"`([A-Z][A-Za-z0-9_]+)`", WORDS)) - EXTERNAL
    keys = set(re.findall(r'`"([a-z_]+)"`', WORDS))
    assert len(classes) > 20 and {"reduction", "iteration"} <= keys, (classes, keys)
    missing = sorted(classes - _defined_names())
    assert not missing, f"docs/design.md's glossary names what commopt does not define: {missing}"
    unknown = sorted(keys - _string_constants())
    assert not unknown, f"docs/design.md's glossary names keys the code never writes: {unknown}"


#: Where a word may not be an identifier: (word, the code it may not name there, why).
FORBIDDEN = [
    (
        "step",
        ("commopt/reducer", "commopt/codecs", "commopt/collectives", "commopt/optim/staleness.py"),
        "a step is one call of opt.step(); the reduction number is `number`/`reduction`, "
        "QSGD's level spacing and the predicted update have names of their own",
    ),
    (
        "layout",
        ("commopt/codecs",),
        "a layout is the reducer's assignment of parameters to buckets (the collectives' "
        "chunk layout); a codec's arrangement of its buffers is its placement",
    ),
]


@pytest.mark.parametrize("word, where, why", FORBIDDEN, ids=[w for w, _, _ in FORBIDDEN])
def test_no_identifier_uses_a_forbidden_meaning(word, where, why):
    found = [
        f"{f.relative_to(ROOT)}:{line}: {name}"
        for f, tree in _modules(*where)
        for name, line in _identifiers(tree)
        if name == word or (word == "layout" and "layout" in name.lower())
    ]
    assert not found, f"{why}: {found}"


def test_a_stage_is_never_a_state_and_one_class_is_called_plan():
    stage_holders, plans = [], []
    for f, tree in _modules("commopt"):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            if node.name == "Plan":
                plans.append(str(f.relative_to(ROOT)))
            uses_stage = any(isinstance(n, ast.Name) and n.id == "Stage" for n in ast.walk(node))
            if "State" in node.name and uses_stage:
                stage_holders.append(f"{f.relative_to(ROOT)}: {node.name}")
    assert not stage_holders, f"a class named *State holds a Stage: {stage_holders}"
    assert plans == ["commopt/optim/plans.py"], f"more than one class is called Plan: {plans}"


def test_schedules_are_the_registered_ones_and_learning_rates_are_not_schedules():
    from commopt.optim import schedules

    optim = COMMOPT / "optim"
    assert not (optim / "schedules.py").exists(), "learning-rate schedules are lr_schedules.py"
    step_schedules = [
        str(f.relative_to(ROOT))
        for f, tree in _modules("commopt/optim")
        if f.stem.endswith("_step")
        and any(isinstance(n, ast.ClassDef) and n.name.endswith("Schedule") for n in tree.body)
    ]
    assert not step_schedules, f"a schedule's module is named for the schedule: {step_schedules}"
    modules = {f.stem for f in (optim / "schedules").glob("*.py")} - {"__init__", "protocol"}
    registered = {where.split(":")[0].rsplit(".", 1)[1] for where in schedules.SCHEDULES.values()}
    assert modules <= registered, f"schedule modules not in the registry: {modules - registered}"


def test_the_checkpoint_saves_the_reduction_number_under_one_name():
    import torch

    import commopt

    model = torch.nn.Linear(3, 2)
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        commopt.create_communicator("local"),
        double_buffering="stale",
    )
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    keys: list[str] = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                keys.append(k)
                walk(v)

    walk(opt.state_dict()["commopt"])
    assert keys.count("reduction") == 2, keys  # the part's counter and its pending reduction
    assert "iteration" not in keys and "step" not in keys, keys


def test_the_glossary_check_finds_a_forbidden_identifier():
    tree = ast.parse("def start(step): self.layout = step")
    names = {name for name, _ in _identifiers(tree)}
    assert {"step", "layout", "start"} <= names
