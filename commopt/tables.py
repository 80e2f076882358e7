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
the dev and recipes extras) terminal text is tabulate's ``simple`` format; without it, or with
``plain=True``, the same layout is written here, so a missing package never costs a table.
Markdown is always the compact pipe table written here: the docs carry generated tables, and
their text must not depend on which optional packages the generating machine has.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["table"]


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    markdown: bool = False,
    plain: bool = False,
    align: str | None = None,
) -> str:
    """``rows`` under ``headers`` as aligned text (or a markdown table with ``markdown=True``).

    A row shorter than the headers is padded with empty cells (e.g. a "failed: ..." row).
    ``align`` is one letter per column, ``l`` or ``r`` (default: the first ``l``, the rest ``r``).

        >>> print(table(["setting", "GB/s"], [["NCCL_ALGO=Ring", "0.1"]], align="ll", plain=True))
        setting         GB/s
        --------------  ----
        NCCL_ALGO=Ring  0.1
    """
    width = len(headers)
    body = [[str(c) for c in r] + [""] * (width - len(r)) for r in rows]
    if any(len(r) > width for r in body):
        raise ValueError(f"a row has more cells than the {width} headers")
    align = align or "l" + "r" * (width - 1)
    if len(align) != width or set(align) - {"l", "r"}:
        raise ValueError(f"align must be {width} letters, each l or r, not {align!r}")
    if markdown:
        return _markdown(headers, body, align)
    if not plain:
        try:
            from tabulate import tabulate
        except ImportError:
            pass
        else:
            return str(
                tabulate(
                    body,
                    headers=list(headers),
                    tablefmt="simple",
                    colalign=["left" if a == "l" else "right" for a in align],
                    disable_numparse=True,
                )
            )
    return _text(headers, body, align)


def _markdown(headers: Sequence[str], body: list[list[str]], align: str) -> str:
    sep = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    lines = ["| " + " | ".join(headers) + " |", sep]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])


def _text(headers: Sequence[str], body: list[list[str]], align: str) -> str:
    cells = [list(headers)] + body
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]

    def line(c: list[str]) -> str:
        return "  ".join(
            s.ljust(w) if a == "l" else s.rjust(w) for s, w, a in zip(c, widths, align)
        ).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(c) for c in body])
