"""The ``canzona`` command.

- ``canzona fit|validate|test|predict``: LightningCLI. Configs are read in omegaconf mode, so YAML
  can interpolate (``${model.init_args.preset}``). Importing `lightning_canzona` registers the
  strategy, so ``strategy: canzona`` needs no import.
- ``canzona plan``: the optimizer plan of a model preset on a mesh, per policy, without weights.
- ``canzona bench``: benchmarks that run canzona and its alternatives side by side.
- ``canzona export``: a checkpoint's model as one safetensors or torch file, or a transformers folder.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path
from types import MethodType
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, instantiate_class
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

import lightning_canzona  # noqa: F401  (registers the "canzona" strategies)
from lightning_canzona.checkpoint import check_file_before_launch
from lightning_canzona.optim import MatrixOptimizer, matrix_param_groups


class CanzonaCLI(LightningCLI):
    """LightningCLI whose top-level ``optimizer:`` is built when the strategy configures optimizers.

    LightningCLI builds that optimizer from ``model.parameters()`` before the trainer starts; a
    sharding strategy then replaces the parameters (the optimizer would hold stale ones) and a model
    built in ``configure_model`` has none yet. Here the optimizer is built from the sharded model,
    and a `lightning_canzona` optimizer gets `matrix_param_groups` (embeddings, heads and norms to
    AdamW) instead of a split by dimensionality. A class that refuses its settings (a model that
    checks its optimizer's) raises its own error, not jsonargparse's report of every type it tried.
    """

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


def main(args: list[str] | None = None) -> None:
    """Run the command on ``args`` (default: the command line)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "plan":
        from lightning_canzona.commands import plan

        plan.main(argv[1:])
        return
    if argv and argv[0] == "export":
        from lightning_canzona.export import main as export

        export(argv[1:])
        return
    if argv and argv[0] == "bench":
        from lightning_canzona.bench.__main__ import main as bench

        bench(argv[1:])
        return
    CanzonaCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        # None reads the command line itself: LightningCLI warns when given it as a list too.
        args=None if args is None else argv,
    )


if __name__ == "__main__":
    main()
