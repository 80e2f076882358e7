"""Tables for the terminal and for markdown, from one list of rows: the benchmarks' one printer.

    >>> print(table(["name", "ms"], [["ddp-fp32", "812"], ["commopt-qsgd4", "95"]], plain=True))
    name            ms
    -------------  ---
    ddp-fp32       812
    commopt-qsgd4   95
    >>> print(table(["name", "ms"], [["ddp-fp32", "812"]], markdown=True, plain=True))
    | name | ms |
    |---|---:|
    | ddp-fp32 | 812 |

Cells are strings, already formatted by the caller (units, digits, "-" for none); the first
column is aligned left, the others right (numbers). With ``tabulate`` installed (it comes with
the dev and recipes extras) the text is tabulate's ``simple`` and ``pipe`` formats; without it,
or with ``plain=True``, the same layout is written here, so a missing package never costs a
table.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, markdown: bool = False,
          plain: bool = False) -> str:
    """``rows`` under ``headers`` as aligned text (or a markdown table with ``markdown=True``).

    A row shorter than the headers is padded with empty cells (e.g. a "failed: ..." row).
    """
    width = len(headers)
    body = [[str(c) for c in r] + [""] * (width - len(r)) for r in rows]
    if any(len(r) > width for r in body):
        raise ValueError(f"a row has more cells than the {width} headers")
    align = ["left"] + ["right"] * (width - 1)
    if not plain:
        try:
            from tabulate import tabulate
        except ImportError:
            pass
        else:
            return tabulate(body, headers=list(headers), tablefmt="pipe" if markdown else "simple",
                            colalign=align, disable_numparse=True)
    if markdown:
        return _markdown(headers, body)
    return _text(headers, body)


def _markdown(headers: Sequence[str], body: list[list[str]]) -> str:
    sep = "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"
    lines = ["| " + " | ".join(headers) + " |", sep]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])


def _text(headers: Sequence[str], body: list[list[str]]) -> str:
    cells = [list(headers)] + body
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]

    def line(c: list[str]) -> str:
        return "  ".join(s.ljust(w) if i == 0 else s.rjust(w)
                         for i, (s, w) in enumerate(zip(c, widths))).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(c) for c in body])
