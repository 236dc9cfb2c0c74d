"""The lowest versions pyproject.toml declares, for CI's floors step (run by Python >= 3.11).

``python .ci/floors.py`` prints pip constraints pinning every dependency to its floor: the
``dependencies`` and the ``dev`` extra (what the README's test command installs), each
``name>=X`` turned into ``name==X``, an environment marker kept. ``python .ci/floors.py --python``
prints the floor of ``requires-python``. A requirement without a single ``>=`` floor is an
error: every floor that is declared is one that CI installs and tests.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*>=\s*([^\s,;]+)\s*(;\s*(.+))?")


def python_floor(project: dict) -> str:
    match = re.fullmatch(r"\s*>=\s*(\d+\.\d+)\s*", project["requires-python"])
    if match is None:
        raise SystemExit(f"requires-python {project['requires-python']!r} is not a single '>=X.Y' floor")
    return match.group(1)


def constraints(project: dict) -> list[str]:
    pins = []
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        match = REQUIREMENT.fullmatch(requirement)
        if match is None:
            raise SystemExit(f"{requirement!r} does not declare a single '>=' floor")
        name, _extras, version, _, marker = match.groups()
        # Constraints take no extras; a marker keeps the pin to where the requirement applies.
        pins.append(f"{name}=={version}" + (f"; {marker}" if marker else ""))
    return pins


if __name__ == "__main__":
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]
    print(python_floor(project) if sys.argv[1:] == ["--python"] else "\n".join(constraints(project)))
