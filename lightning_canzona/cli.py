"""The ``canzona`` command.

- ``canzona fit|validate|test|predict``: LightningCLI. Configs are read in omegaconf mode, so YAML
  can interpolate (``${model.init_args.preset}``). Importing `lightning_canzona` registers the
  strategy, so ``strategy: canzona`` needs no import.
- ``canzona plan|bench|export|doctor``: the tools (`lightning_canzona.tools`), each its own
  module's ``main``, imported only when its command runs (`COMMANDS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import sys
import traceback
import typing
from pathlib import Path
from types import MethodType
from typing import Any, NoReturn

from jsonargparse import Namespace, dict_to_namespace
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, instantiate_class
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

import lightning_canzona  # noqa: F401  (registers the "canzona" strategies)
from lightning_canzona.checkpoint import check_file_before_launch
from lightning_canzona.compat import check_option_values_with, nested_option
from lightning_canzona.optim import MatrixOptimizer, matrix_param_groups
from lightning_canzona.tools.command import CommandParser

#: The Trainer's strategy in LightningCLI's config.
STRATEGY = "trainer.strategy"
#: Keys of a class's spec in jsonargparse's config that are not the class's settings.
SPEC_KEYS = {"class_path", "init_args", "dict_kwargs", "__path__"}


class UnknownSetting(TypeError):
    """A setting that the class it is given to does not take (a `TypeError`, as jsonargparse's
    own errors are)."""


class CanzonaArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, where ``trainer.strategy`` takes the settings of a registered
    strategy by name (`strategy_settings`) and an error is the error, not the usage of every
    option (over 50 lines for ``fit``; ``--help`` prints it)."""

    def add_lightning_class_args(
        self, lightning_class: Any, nested_key: str, *args: Any, **kwargs: Any
    ) -> list[str]:
        added = super().add_lightning_class_args(lightning_class, nested_key, *args, **kwargs)
        if nested_key == "trainer":
            check_option_values_with(self, f"--{STRATEGY}", strategy_settings)
        return added

    def print_usage(self, file: Any = None) -> None:
        """Nothing: an error names ``--help`` instead."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        cause: BaseException | None = ex
        while cause is not None and not isinstance(cause, UnknownSetting):
            cause = cause.__cause__ or cause.__context__
        super().error(message if cause is None else str(cause), ex)


def strategy_settings(value: Any, config: Namespace | None) -> Any:
    """``trainer.strategy`` as jsonargparse should see it: a name of Lightning's strategy
    registry given settings (``--trainer.strategy.tensor_parallel_size 1`` after ``strategy:
    canzona``, or ``class_path: canzona`` with ``init_args:``) becomes its class with its
    registered settings (``canzona_notebook``: ``start_method: fork``) under the given ones.

    A name alone stays a name, which the Trainer looks up itself.

    Raises:
        UnknownSetting: A setting that the strategy's class does not take, with the nearest one
            it takes.
    """
    if isinstance(value, str):  # a name, a class path or a file: nothing to merge with yet
        return value
    given = config.get(STRATEGY) if config is not None else None
    if isinstance(given, str) and given in StrategyRegistry:
        config[STRATEGY] = given = dict_to_namespace(_registered(given))
    nested = nested_option(value)
    if nested is not None:
        _check_settings(given, [nested[0]])
        return value
    if isinstance(value, Namespace):
        value = value.as_dict()
    if not isinstance(value, dict):
        return value
    if value.get("class_path") in StrategyRegistry:
        value = {**value, **_registered(value["class_path"], value.get("init_args"))}
    if "class_path" in value or "init_args" in value:
        _check_settings(value if "class_path" in value else given, _dotted(value.get("init_args") or {}))
    else:  # the settings alone, for the class given before
        _check_settings(given, _dotted(value))
    return value


def _registered(name: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The class and settings that Lightning's strategy registry holds under ``name``, with
    ``settings`` over them."""
    entry = StrategyRegistry[name]
    strategy = entry["strategy"]
    package = strategy.__module__.split(".")[0]
    exported = getattr(sys.modules[package], strategy.__name__, None) is strategy
    return {
        "class_path": f"{package if exported else strategy.__module__}.{strategy.__name__}",
        "init_args": {**entry["init_params"], **(settings or {})},
    }


def _dotted(settings: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys of nested settings, dotted: ``{"plan": {"policy": "lpt"}}`` → ``["plan.policy"]``."""
    keys = []
    for name, setting in settings.items():
        if isinstance(setting, dict) and setting and not SPEC_KEYS & setting.keys():
            keys += _dotted(setting, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _check_settings(spec: Any, keys: list[str]) -> None:
    """Raise `UnknownSetting` for the first of ``keys`` that the class of ``spec`` (a
    ``class_path`` and its ``init_args``) does not take; nothing where the class is unknown
    (jsonargparse reports that itself)."""
    class_path = spec.get("class_path") if isinstance(spec, (dict, Namespace)) else None
    if not class_path:
        return
    module_name, _, class_name = class_path.rpartition(".")
    try:
        strategy = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        return
    for key in keys:
        if key.split(".", 1)[0] in SPEC_KEYS:
            continue
        message = _unknown_setting(strategy, key)
        if message:
            raise UnknownSetting(message)


def _unknown_setting(cls: type, key: str) -> str | None:
    """The error for a dotted setting (``plan.policy``: into a dataclass) that ``cls`` does not
    take, or None."""
    names = key.split(".")
    owner: Any = cls
    for depth, name in enumerate(names):
        settings = _settings_of(owner)
        if settings is None:  # takes any keyword
            return None
        if name not in settings:
            close = difflib.get_close_matches(name, settings, n=1)
            guess = f"; did you mean {'.'.join([*names[:depth], close[0]])!r}?" if close else ""
            return (
                f"{STRATEGY}: {cls.__name__} has no setting {key!r}{guess} "
                f"(--{STRATEGY}.help {cls.__name__} lists them)"
            )
        owner = next(
            (t for t in typing.get_args(settings[name]) or (settings[name],) if _is_dataclass(t)), None
        )
        if owner is None:  # a value, not settings of its own
            return None
    return None


def _settings_of(owner: type) -> dict[str, Any] | None:
    """The settings a class's constructor or a dataclass takes, with their types; None for a
    class that takes any keyword."""
    try:
        hints = typing.get_type_hints(owner.__init__ if not _is_dataclass(owner) else owner)
    except Exception:  # an annotation that does not resolve here: names alone
        hints = {}
    if _is_dataclass(owner):
        return {field.name: hints.get(field.name) for field in dataclasses.fields(owner) if field.init}
    parameters = inspect.signature(owner).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    return {p.name: hints.get(p.name) for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}


def _is_dataclass(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


class CanzonaCLI(LightningCLI):
    """LightningCLI whose top-level ``optimizer:`` is built when the strategy configures optimizers.

    LightningCLI builds that optimizer from ``model.parameters()`` before the trainer starts; a
    sharding strategy then replaces the parameters (the optimizer would hold stale ones) and a model
    built in ``configure_model`` has none yet. Here the optimizer is built from the sharded model,
    and a `lightning_canzona` optimizer gets `matrix_param_groups` (embeddings, heads and norms to
    AdamW) instead of a split by dimensionality. A class that refuses its settings (a model that
    checks its optimizer's) raises its own error, not jsonargparse's report of every type it tried.
    Its parser is a `CanzonaArgumentParser`: a registered strategy's settings from YAML and the
    command line (``--trainer.strategy.tensor_parallel_size 1`` after ``strategy: canzona``).
    """

    def __init__(
        self, *args: Any, parser_class: type[LightningArgumentParser] = CanzonaArgumentParser, **kwargs: Any
    ) -> None:
        super().__init__(*args, parser_class=parser_class, **kwargs)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            refused = _raised_by_a_class(error)
            if refused is None:
                raise
            raise refused from None

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse the command line, then check a single-file ``ckpt_path`` before LightningCLI
        reads its hyperparameters in this process: a damaged file is the strategy's
        ``CorruptCheckpointError`` naming it, here and before any rank starts, not torch's error
        from inside LightningCLI (`lightning_canzona.checkpoint.check_file_before_launch`;
        the records' checksums too unless the config sets ``verify_checkpoints: false``)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        settings = self.config.get(subcommand) if subcommand else None
        ckpt_path = settings.get("ckpt_path") if settings is not None else None
        if ckpt_path and Path(ckpt_path).is_file():
            strategy = settings.get("trainer.strategy")
            verify = (
                strategy.get("init_args.verify_checkpoints", True)
                if isinstance(strategy, Namespace)
                else True
            )
            check_file_before_launch(Path(ckpt_path), verify_files=verify is not False)

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        optimizer_init = self._get(self.config_init, "optimizer") if self.auto_configure_optimizers else None
        if not optimizer_init:
            super()._add_configure_optimizers_method_to_model(subcommand)
            return
        scheduler_init = self._get(self.config_init, "lr_scheduler")
        if is_overridden("configure_optimizers", self.model):
            rank_zero_warn(
                f"`{type(self.model).__name__}.configure_optimizers` is replaced by the top-level "
                "`optimizer:` of the config."
            )
        configure = self.configure_optimizers

        def configure_optimizers(model: LightningModule) -> Any:
            optimizer = instantiate_class(
                _optimizer_params(model, optimizer_init["class_path"]), optimizer_init
            )
            scheduler = instantiate_class(optimizer, scheduler_init) if scheduler_init else None
            return configure(model, optimizer, scheduler)

        self.model.configure_optimizers = MethodType(configure_optimizers, self.model)


def _raised_by_a_class(error: BaseException) -> BaseException | None:
    """The error that a class's own code raised inside jsonargparse's ``error``, if any:
    jsonargparse reports a class that refused its settings as a value of none of the types it
    tried, with the class's error only as its context."""
    inner = error.__cause__ or error.__context__
    while inner is not None:
        frames = traceback.extract_tb(inner.__traceback__)
        if frames and f"{os.sep}jsonargparse{os.sep}" not in frames[-1].filename:
            return inner
        inner = inner.__cause__ or inner.__context__
    return None


def _optimizer_params(model: LightningModule, class_path: str) -> Any:
    module_name, _, class_name = class_path.rpartition(".")
    optimizer_class: type[Optimizer] = getattr(importlib.import_module(module_name), class_name)
    if issubclass(optimizer_class, MatrixOptimizer):
        return matrix_param_groups(model)
    return model.parameters()


#: LightningCLI's commands, and what each does.
TRAINER_COMMANDS = {
    "fit": "Train a model: canzona fit --config examples/configs/tiny.yaml",
    "validate": "One evaluation epoch over the validation set.",
    "test": "One evaluation epoch over the test set.",
    "predict": "The model's predictions on the predict set.",
}
#: The tools (`lightning_canzona.tools`): the module whose ``main(argv)`` runs each, and what it does.
COMMANDS = {
    "plan": (
        "lightning_canzona.tools.plan",
        "A model preset's optimizer plan on a mesh, per policy, without weights.",
    ),
    "bench": (
        "lightning_canzona.tools.bench",
        "Benchmarks that run canzona and its alternatives side by side.",
    ),
    "export": (
        "lightning_canzona.tools.export",
        "A checkpoint's model as one safetensors or torch file, or a transformers folder.",
    ),
    "doctor": (
        "lightning_canzona.tools.doctor",
        "Check this machine: versions, numerics on its devices, a checkpointed run (--quick: 1 min).",
    ),
}


def main(args: list[str] | None = None) -> None:
    """Run the command on ``args`` (default: the command line)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in COMMANDS:
        importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
        return
    if (
        not argv
        or argv[0] in ("-h", "--help")
        or not (argv[0] in TRAINER_COMMANDS or argv[0].startswith("-"))
    ):
        _commands().parse_args(argv[:1] or ["--help"])  # the help, or the choices of an unknown command
    CanzonaCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf", "prog": "canzona"},
        save_config_kwargs={"overwrite": True},
        # None reads the command line itself: LightningCLI warns when given it as a list too.
        args=None if args is None else argv,
    )


def _commands() -> CommandParser:
    """``canzona``'s own parser: every command, with what it does (each parses its own options)."""
    parser = CommandParser(
        prog="canzona",
        description="Lightning training with exact, non-redundant matrix optimizers (lightning_canzona).",
        epilog="canzona COMMAND --help: the options of a command. fit, validate, test and predict are "
        "LightningCLI's: --config FILE, --print_config, --trainer.strategy.tensor_parallel_size 2…",
    )
    commands = parser.add_subcommands(title="commands", metavar="COMMAND")
    for name, description in {
        **TRAINER_COMMANDS,
        **{name: help for name, (_, help) in COMMANDS.items()},
    }.items():
        commands.add_subcommand(name, CommandParser(add_help=False), help=description)
    return parser


if __name__ == "__main__":
    main()
