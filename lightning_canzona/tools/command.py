"""The command line of every tool: a command is a function, its signature and Google-style
docstring its options.

`run` builds a jsonargparse parser from the function (or from a mapping of subcommand names to
functions), parses the arguments and calls the function with them, so that each option is
declared once, where the command uses it. A parameter ``max_team: int = 4`` becomes
``--max-team`` with default 4 and the help of its ``Args:`` entry; a parameter without a default
is positional; a ``bool`` is a flag with a ``--no-`` form; a ``tuple[X, ...]`` takes one value or
more; a ``Literal`` lists its choices. The docstring's description is the command's ``--help``.

Two kinds of error, each one clear message and no traceback: what jsonargparse refuses (a
misspelt option, with the nearest one it knows; a value of the wrong type), and `UsageError`,
which a command raises for arguments that parse but do not fit together, before it starts work
(``PROG: error: MESSAGE``, exit status 2)::

    def plan(preset: str = "0.6B", dp: int = 8) -> None:
        '''A preset's plan.

        Args:
            preset: Qwen3 preset.
            dp: Data-parallel size.
        '''

    run(plan, ["--dp", "32"], prog="canzona plan")
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
import textwrap
import typing
from argparse import SUPPRESS, Action
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NoReturn

import docstring_parser
from jsonargparse import ActionYesNo, ArgumentParser, DefaultHelpFormatter

Command = Callable[..., Any]


class UsageError(ValueError):
    """Arguments that parse but that the command cannot run with: printed as one line,
    ``PROG: error: MESSAGE``, with exit status 2."""


class HelpFormatter(DefaultHelpFormatter):
    """``--help`` with each option's default after its help (not where it is None or False, or
    the help gives it), without jsonargparse's type (the usage shows it), and descriptions with
    their lines as written (lists and examples)."""

    def _get_help_string(self, action: Action) -> str:
        help = (action.help or "").replace("%", "%%")
        default = action.default
        if action.option_strings and default not in (None, False, SUPPRESS) and "(default" not in help:
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
            help += f" (default: {shown})".replace("%", "%%")
        return help

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = [
            line if line[:1].isspace() else textwrap.fill(line, width) or line for line in text.splitlines()
        ]
        return "\n".join(textwrap.indent(line, indent) for line in lines)


class CommandParser(ArgumentParser):
    """jsonargparse's parser with `HelpFormatter`, whose errors are the error alone (``--help``
    prints the usage) and name the nearest option to a misspelt one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=HelpFormatter, **kwargs)

    def print_usage(self, file: Any = None) -> None:
        """Nothing: an error names ``--help`` instead."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (--[^\s=]+)", message, re.IGNORECASE)
        if unknown:
            close = difflib.get_close_matches(unknown.group(1), list(self._option_string_actions), n=1)
            message += f" (did you mean {close[0]}?)" if close else ""
        super().error(message, ex)


def plain(text: str) -> str:
    """Docstring markup as plain text: double or single backticks around code and names
    dropped, ``::`` before an example a colon."""
    return re.sub(r"``?([^`]+?)``?", r"\1", text).replace("::\n", ":\n").strip()


def summary(command: Command) -> str:
    """The first line of ``command``'s docstring, as plain text: its line in a list of commands."""
    return plain((command.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "))


def parser(command: Command | Mapping[str, Command], prog: str, description: str = "") -> CommandParser:
    """The parser of ``command``: a function's options, or a subcommand for each function of a
    mapping (``description`` describes the group; a function describes itself)."""
    if callable(command):
        built = CommandParser(prog=prog, description=description or _description(command))
        _add_parameters(built, command)
        return built
    built = CommandParser(prog=prog, description=description)
    subcommands = built.add_subcommands(dest="command")
    for name, function in command.items():
        subparser = CommandParser(description=_description(function))
        _add_parameters(subparser, function)
        subcommands.add_subcommand(name, subparser, help=summary(function))
    return built


def run(
    command: Command | Mapping[str, Command], argv: Sequence[str], prog: str, description: str = ""
) -> Any:
    """Parse ``argv`` with ``command``'s `parser` and call the function it names with the
    values; a `UsageError` it raises ends the process with its message and exit status 2."""
    config = parser(command, prog, description).parse_args(list(argv))
    if callable(command):
        function, values = command, config.as_dict()
    else:
        function, values = command[config.command], config[config.command].as_dict()
    values = {name: tuple(value) if isinstance(value, list) else value for name, value in values.items()}
    try:
        return function(**values)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _description(command: Command) -> str:
    return plain(docstring_parser.parse(command.__doc__ or "").description or "")


def _add_parameters(parser: ArgumentParser, command: Command) -> None:
    """An argument for each parameter of ``command`` (see the module's docstring)."""
    hints = typing.get_type_hints(command)
    documented = docstring_parser.parse(command.__doc__ or "").params
    helps = {param.arg_name: param.description for param in documented}
    for name, parameter in inspect.signature(command).parameters.items():
        if name not in helps:  # the command's author finds out at once, not a user
            raise TypeError(f"{command.__qualname__}'s docstring does not describe its parameter {name!r}")
        hint, help = hints[name], plain(helps[name] or "")
        if parameter.default is inspect.Parameter.empty:
            parser.add_argument(name, type=hint, help=help)
            continue
        settings: dict[str, Any] = {"dest": name, "default": parameter.default, "help": help}
        if hint is bool:
            settings["action"] = ActionYesNo(no_prefix="no-")
        elif typing.get_origin(hint) is tuple:  # jsonargparse gives a list, and takes one as default
            settings.update(nargs="+", type=typing.get_args(hint)[0], default=list(parameter.default))
        else:
            settings["type"] = hint
        choices = _choices(settings.get("type"))
        if choices:
            settings["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        parser.add_argument("--" + name.replace("_", "-"), **settings)


def _choices(hint: Any) -> tuple[Any, ...]:
    """The values of a ``Literal`` hint, optional or not; none for other hints."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return next((_choices(arg) for arg in typing.get_args(hint) if typing.get_origin(arg) is Literal), ())
