"""The tools' command line (`lightning_canzona.tools.command`): a function's signature and
docstring are its options, and bad input is one clear error."""

from __future__ import annotations

import contextlib
import io
from typing import Literal

import pytest

from lightning_canzona.tools.command import UsageError, run
from lightning_canzona.tools.tables import table


def _measure(
    preset: Literal["tiny", "small"] = "tiny",
    max_team: int = 8,
    simulate: bool = True,
    quick: bool = False,
    shapes: tuple[str, ...] = ("4x8", "8x4"),
    backend: str | None = None,
) -> dict:
    """Measure something.

    Args:
        preset: Qwen3 preset
        max_team: most ranks a team
        simulate: print projections
        quick: small sizes
        shapes: matrix shapes
        backend: the backend

    Raises:
        UsageError: A max_team below 1.
    """
    if max_team < 1:
        raise UsageError(f"--max-team must be >= 1, got {max_team}")
    return dict(
        preset=preset, max_team=max_team, simulate=simulate, quick=quick, shapes=shapes, backend=backend
    )


def _fails(*argv: str) -> list[str]:
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(io.StringIO()) as printed:
        run(_measure, argv, prog="canzona measure")
    assert exited.value.code == 2
    return printed.getvalue().splitlines()


def test_the_options_keep_the_command_lines_spellings() -> None:
    assert run(_measure, [], prog="canzona measure") == dict(
        preset="tiny", max_team=8, simulate=True, quick=False, shapes=("4x8", "8x4"), backend=None
    )
    given = ["--preset", "small", "--max-team", "2", "--no-simulate", "--quick", "--shapes", "2x3", "3x2"]
    assert run(_measure, given, prog="canzona measure") == dict(
        preset="small", max_team=2, simulate=False, quick=True, shapes=("2x3", "3x2"), backend=None
    )


def test_the_help_is_the_docstring_with_each_default(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        run(_measure, ["--help"], prog="canzona measure")
    printed = " ".join(capsys.readouterr().out.split())
    assert exited.value.code == 0 and printed.startswith("usage: canzona measure")
    assert "Measure something." in printed and "--preset {tiny,small}" in printed
    assert "most ranks a team (default: 8)" in printed and "matrix shapes (default: 4x8 8x4)" in printed
    assert "the backend (default" not in printed and "type:" not in printed


def test_a_misspelt_option_is_one_error_naming_the_nearest() -> None:
    error = _fails("--max-tem", "2")[-1].lower()  # "Unrecognized" before jsonargparse 4.40
    assert error == "error: unrecognized arguments: --max-tem 2 (did you mean --max-team?)"
    assert "Traceback" not in "\n".join(_fails("--preset", "huge"))


def test_arguments_the_command_refuses_are_one_line() -> None:
    assert _fails("--max-team", "0") == ["canzona measure: error: --max-team must be >= 1, got 0"]


def test_a_parameter_without_help_is_the_authors_error() -> None:
    def undocumented(size: int = 1) -> None:
        """Nothing about size."""

    with pytest.raises(TypeError, match="does not describe its parameter 'size'"):
        run(undocumented, [], prog="canzona undocumented")


def test_a_table_aligns_labels_left_and_figures_right() -> None:
    assert table(
        ["policy", "max/mean", "teams"], [["canzona", "1.002", "2 by 4"], ["lpt", "11.5", "-"]], left=(0, 2)
    ) == ("policy   max/mean  teams\ncanzona     1.002  2 by 4\nlpt          11.5  -")
    with pytest.raises(ValueError, match="a row has 1 cells for 2 headers"):
        table(["a", "b"], [["1"]])
