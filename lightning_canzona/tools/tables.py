"""The one table formatter of the tools: `table` lays out rows of text under their headers.

Every table the commands and benchmarks print goes through it, so that they all look alike and
none pads its columns by hand. rich measures and aligns the columns (by the width a terminal
gives each character, ``×`` and ``÷`` included); the output is plain text, the same on a
terminal, in a pipe and in a test: no colour, no box, no wrapping, however narrow the terminal,
and a header may take several lines (``"step\\n[ms]"``). Callers format their numbers
themselves (``f"{x:.3f}"``), so each column says how precise it is::

    print(table(["policy", "max/mean"], [["canzona", "1.002"], ["lpt", "1.031"]]))
"""

from __future__ import annotations

import io
from collections.abc import Collection, Iterable, Sequence

from rich.console import Console
from rich.table import Table

#: Wider than any table: the console never wraps or crops one.
_UNLIMITED = 1_000_000


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    left: Collection[int] = (0,),
    margin: int = 0,
) -> str:
    """``rows`` under ``headers``, one line a row, columns two spaces apart.

    Args:
        headers: The columns' headers.
        rows: The cells of each row (``str()`` of each), as many as there are headers.
        left: Indices of the columns aligned left (labels); the others align right (figures).
        margin: Spaces before every line.

    Returns:
        The lines, without trailing spaces or a final newline.

    Raises:
        ValueError: A row has more or fewer cells than there are headers.
    """
    laid_out = Table(box=None, padding=(0, 2, 0, 0), pad_edge=False, show_edge=False, expand=False)
    for index, header in enumerate(headers):
        laid_out.add_column(header, justify="left" if index in left else "right", no_wrap=True)
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a row has {len(row)} cells for {len(headers)} headers: {list(row)}")
        laid_out.add_row(*map(str, row))
    text = io.StringIO()
    console = Console(
        file=text,
        width=_UNLIMITED,
        color_system=None,
        force_terminal=False,
        markup=False,
        highlight=False,
        emoji=False,
        soft_wrap=False,
    )
    console.print(laid_out)
    return "\n".join(" " * margin + line.rstrip() for line in text.getvalue().splitlines())
