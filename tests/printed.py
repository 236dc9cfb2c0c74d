"""The warnings in what a run printed (a script, a notebook's cells, the CLI)."""

from __future__ import annotations

import re

#: A warning as Python prints it (``file:line: Category: message``), as Lightning prints its own
#: (``file:line: message``, no category), or as a logger does (``WARNING``, ``[warn]``…).
_WARNING = re.compile(r"^\S+:\d+: |warn", re.IGNORECASE | re.MULTILINE)


def warning_lines(printed: str) -> list[str]:
    """The lines of ``printed`` that are warnings: none, in a correct run of what the package ships."""
    return [line for line in printed.splitlines() if _WARNING.search(line)]
