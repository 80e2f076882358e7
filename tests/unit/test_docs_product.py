"""The docs and the code speak of the product: no working notes in docs/, README.md,
CONTRIBUTING.md, commopt/, benchmarks/ or recipes/.

A working note is text about how the project was made rather than about what it does:
tracker numbers ("issue 5", "#12"), who ran what on which machine ("lent", "the session
that ..."), paths outside the repository, or why a file is long. Citations of other
projects' threads keep their owner/name (``NVIDIA/nccl#209``) and are not notes.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NOTES = {
    "a tracker number": r"\b(?:issue|PR|pull request)s? ?#?\d+",
    "a bare thread number": r"(?<![\w/.\-`])#\d{1,5}\b(?![\w-])",
    "a working session": r"\b(?:this|that|the|these|those|previous|earlier|later|another|"
    r"other|which|whose|in a|by a|each) sessions?\b(?! of )",
    "a lent machine": r"\blent\b",
    "a helper or lead": r"\b(?:the lead|helpers? (?:session|branch|agent)s?)\b|HELPERS\.md",
    "why a file is long": r"\bover \d+ lines\b|\blines on purpose\b",
    "a path outside the repository": r"/work/|\bshared/reference\b|docs/dev/",
    "who had a GPU": r"\bno GPU (?:machine )?(?:was|has been) (?:lent|available)",
}
PATTERN = re.compile("|".join(f"(?P<n{i}>{p})" for i, p in enumerate(NOTES.values())), re.I)
NAMES = list(NOTES)


def _files() -> list[Path]:
    out = [REPO / "README.md", REPO / "CONTRIBUTING.md"]
    out += sorted(p for p in (REPO / "docs").rglob("*") if p.suffix in (".md", ".json", ".py"))
    for package in ("commopt", "benchmarks", "recipes"):
        out += sorted((REPO / package).rglob("*.py"))
    return out


def find_notes(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, the matched text) of every working note in ``text``.

    >>> find_notes("Target (issue 6): BLEU\\nNCCL 2.4 (NVIDIA/nccl#209) and color '#999999'")
    [(1, 'a tracker number', 'issue 6')]
    """
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in PATTERN.finditer(line):
            kind = NAMES[int(next(k for k, v in m.groupdict().items() if v)[1:])]
            found.append((number, kind, m.group(0)))
    return found


def test_the_patterns_catch_the_notes_they_name():
    notes = [
        "Against the targets (issue 5)",
        "fixed in #12",
        "No GPU machine was lent to the session that produced these pages",
        "under the load of this session's shared machine",
        "Over 400 lines on purpose: one command",
        "see /work/shared/reference/published-results.md",
        "No GPU has been lent to this project so far",
    ]
    for note in notes:
        assert find_notes(note), note
    product = [
        "a helper thread per socket (google/nccl-fastsocket#2)",
        "Each process gets its own session, so a Ctrl-C reaches only the launcher",
        "| `step()` | nothing |",
        'color="#333333"',
        "the issue order of the collectives",
    ]
    for text in product:
        assert not find_notes(text), text


def test_docs_and_code_carry_no_working_notes():
    found = [
        f"{path.relative_to(REPO)}:{line}: {kind}: {text!r}"
        for path in _files()
        for line, kind, text in find_notes(path.read_text(errors="replace"))
    ]
    assert not found, "working notes (say what the product does instead):\n" + "\n".join(found)
