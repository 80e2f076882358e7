"""The README's "Use" program, taken verbatim from README.md, runs on 2 real MPI ranks.

A user pastes that block into train.py and launches it with mpirun; this test does the
same, so the README cannot drift from the API (it once used an undefined ``loader``).
"""

from __future__ import annotations

import re

import pytest

from tests.multirank import REPO, run_mpi, run_torch

pytestmark = pytest.mark.distributed

#: Python's -W flags, for every module: a FutureWarning or DeprecationWarning is an error.
WARNINGS_AS_ERRORS = {"PYTHONWARNINGS": "error::FutureWarning,error::DeprecationWarning"}


def use_snippet(readme: str) -> str:
    """The first ```python block of the README's "## Use" section."""
    section = readme.split("\n## Use\n", 1)
    assert len(section) == 2, "README.md has no '## Use' section"
    body = section[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", body, re.S)
    assert match, "README.md's Use section has no ```python block"
    return match.group(1)


def test_use_snippet_is_extracted_whole():
    code = use_snippet((REPO / "README.md").read_text())
    compile(code, "README.md#use", "exec")  # a syntax error names the README
    assert "create_multi_node_optimizer" in code and "opt.flush()" in code


def test_use_snippet_trains_on_two_ranks_with_identical_weights():
    code = use_snippet((REPO / "README.md").read_text())
    outs = run_mpi(code, 2, timeout=180, env=WARNINGS_AS_ERRORS)  # and warns nothing
    pattern = re.compile(r"rank (\d): loss ([\d.]+) -> ([\d.]+), weights sum (-?[\d.]+)")
    rows = []
    for rank, out in enumerate(outs):
        m = pattern.search(out)
        assert m, f"rank {rank} printed no result line: {out!r}"
        assert int(m.group(1)) == rank, f"rank {rank} reported itself as rank {m.group(1)}"
        first, last = float(m.group(2)), float(m.group(3))
        assert last < first / 4, f"rank {rank}: loss {first} -> {last} did not fall 4x"
        rows.append(m.group(4))
    assert rows[0] == rows[1], f"ranks ended with different weights: {rows}"


def test_use_snippet_on_the_torch_communicator_warns_nothing():
    """The README's program with ``-W error::FutureWarning -W error::DeprecationWarning``
    (the mpi run above has them too): no warning reaches a user who did nothing wrong (the
    torch communicator once looked for DDP models past torch's deprecated ``reduce_op``)."""
    code = use_snippet((REPO / "README.md").read_text())
    code = code.replace('create_communicator("mpi")', 'create_communicator("torch")')
    assert 'create_communicator("torch")' in code, "the README's Use program changed"
    outs = run_torch(code, 2, timeout=180, env=WARNINGS_AS_ERRORS)
    for rank, out in enumerate(outs):
        assert f"rank {rank}: loss" in out, f"rank {rank} printed no result line: {out!r}"
