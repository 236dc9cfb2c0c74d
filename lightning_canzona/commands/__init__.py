"""Sub-commands of the ``canzona`` console command that are not LightningCLI's, and the help that
every one of them prints (`HelpFormatter`, `described`)."""

from __future__ import annotations

import argparse
import re


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default after its help (unless the help says it), and the
    description as written (its lists and examples keep their lines)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        shown = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not shown and "(default" not in help:
            help += " (default: %(default)s)"
        return help


def described(docstring: str) -> str:
    """A module's docstring as a command's description, its markup (double or single backticks
    around code and names, ``::`` before an example) as plain text."""
    return re.sub(r"``?([^`]+?)``?", r"\1", docstring).replace("::\n", ":\n").strip()
