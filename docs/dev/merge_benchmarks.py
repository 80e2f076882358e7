"""Assemble docs/benchmarks.md from the per-area result sections (run from the repo root)."""

from pathlib import Path

DOCS = Path("docs")
SECTIONS = [
    "benchmarks-allreduce.md",
    "benchmarks-step.md",
    "benchmarks-optimizer.md",
    "benchmarks-codecs.md",
]
INTRO = """# Benchmarks

Measured on this project's development machine: 2 cores, no GPU, shared with other jobs while
these numbers were taken (so each table compares configurations side by side in one run, and
ratios matter more than absolute times). Slow links are emulated with `commopt launch --link`
(network namespaces joined by tbf-shaped veth pairs; see [testbed.md](testbed.md)). Every table
gives the exact command, the link rate and the physical limit beside the measured time; the
allreduce limit is 2(n-1)/n x bytes / rate.

No GPU machine was lent to the session that produced these pages: CUDA kernel and NCCL
figures are not measured yet (the scripts add those tables when run on a GPU).

"""
parts = [INTRO]
for name in SECTIONS:
    path = DOCS / name
    if path.exists():
        text = path.read_text().strip()
        # Demote every heading one level, unless the section starts at level 2 already.
        lines = text.splitlines()
        demote = lines[0].startswith("# ")
        in_code = False
        for i, line in enumerate(lines):
            if line.startswith("```"):
                in_code = not in_code
            elif demote and not in_code and line.startswith("#"):
                lines[i] = "#" + line
        parts.append("\n".join(lines) + "\n")
(DOCS / "benchmarks.md").write_text("\n".join(parts))
print("wrote docs/benchmarks.md from", [s for s in SECTIONS if (DOCS / s).exists()])
