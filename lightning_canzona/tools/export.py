"""``canzona export``: the command line of `lightning_canzona.export_checkpoint`, whose refusals
are one line saying what to pass."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lightning_canzona.export import Format, export_checkpoint, module_from_config
from lightning_canzona.tools.command import UsageError, run


def export(
    checkpoint: str,
    output: str,
    format: Format = "safetensors",
    config: str | None = None,
    model_key: str | None = None,
) -> None:
    """Write a checkpoint's model as one safetensors or torch file, or a transformers folder.

    Args:
        checkpoint: a distributed checkpoint's folder (any mesh) or a single file
        output: the file to write, or the folder (--format transformers)
        format: what to write
        config: for --format transformers: the training config whose model: builds the
            LightningModule (on the meta device); by default, the module that the checkpoint's
            hyperparameters name
        model_key: the key that holds the model: state_dict (Trainer) or the model's key in
            fabric.save's state; by default, the one key that holds a model

    Raises:
        UsageError: The checkpoint or the arguments cannot give the export asked for (what
            `export_checkpoint` refuses, which says what to pass).
    """
    try:
        module = module_from_config(config) if config else None
        written = export_checkpoint(checkpoint, output, format, module, model_key)
    except (ValueError, FileNotFoundError) as error:  # what to pass, in one line
        raise UsageError(str(error)) from None
    print(f"lightning_canzona: wrote {written} ({format})")


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``canzona export`` with the arguments after ``export``."""
    run(export, sys.argv[1:] if argv is None else argv, prog="canzona export")
