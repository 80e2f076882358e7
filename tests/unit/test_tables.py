"""commopt.tables: the one table printer, with tabulate and with its plain fallback."""

import pytest

from commopt.tables import table

HEADERS = ["configuration", "step ms", "speed-up"]
ROWS = [
    ["ddp-fp32", "812", "1.00x"],
    ["commopt-qsgd4+ef-db", "95", "8.55x"],
    ["ddp-fp16", "failed: boom"],
]


def _cells(line, markdown):
    if markdown:
        return [c.strip() for c in line.strip().strip("|").split("|")]
    return line.split()


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("markdown", [True, False])
def test_both_printers_give_the_same_cells_aligned(plain, markdown):
    if not plain:
        pytest.importorskip("tabulate")
    lines = table(HEADERS, ROWS, markdown=markdown, plain=plain).splitlines()
    assert len(lines) == 2 + len(ROWS)
    assert _cells(lines[2], markdown) == ROWS[0]
    assert _cells(lines[3], markdown) == ROWS[1]
    if markdown:
        assert _cells(lines[4], markdown) == ROWS[2] + [""]  # padded to every column
        assert lines[1].replace(" ", "").endswith("---:|")  # numbers aligned right
    else:
        # Columns after the first are aligned right: the numbers end in the same column.
        assert lines[2].index("812") + 3 == lines[3].index("95") + 2
        assert lines[2].rstrip().endswith("1.00x") and lines[3].rstrip().endswith("8.55x")


def test_a_row_longer_than_the_headers_is_refused():
    with pytest.raises(ValueError, match="more cells than the 3 headers"):
        table(HEADERS, [["a", "b", "c", "d"]])
