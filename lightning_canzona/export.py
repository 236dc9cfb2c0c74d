"""A checkpoint as files that other tools read: the whole model in one ``safetensors`` or torch
file, or a Hugging Face ``transformers`` directory that ``from_pretrained`` loads.

A distributed checkpoint, saved at any mesh, is consolidated in this process by DCP itself: each
model tensor is read whole, from whichever shards hold it, into one full copy of the weights in
host memory (the optimizer's state is left out). The checkpoint is verified first
(`lightning_canzona.checkpoint.integrity`) and read without running any of its code
(`lightning_canzona.checkpoint.reading`).

``canzona export CHECKPOINT OUTPUT [--format …] [--config CONFIG]`` runs `export_checkpoint` from the command
line.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_canzona import huggingface
from lightning_canzona.checkpoint.integrity import verify
from lightning_canzona.checkpoint.reading import MODEL_KEY, SafeReader, load_file, safe_load

log = logging.getLogger(__name__)

Format = Literal["safetensors", "torch", "transformers"]
FORMATS: tuple[Format, ...] = ("safetensors", "torch", "transformers")


def consolidated_weights(checkpoint: str | Path, model_key: str = MODEL_KEY) -> dict[str, Tensor]:
    """Every model tensor of a Lightning checkpoint, whole, on the CPU, by its name in the
    model's state dict.

    Args:
        checkpoint: A distributed checkpoint's folder (saved at any mesh) or a single file.
        model_key: The key that holds the model: ``"state_dict"`` in ``Trainer``'s checkpoints,
            the model's key in the state given to ``fabric.save``.

    Raises:
        CorruptCheckpointError: A file of the checkpoint is missing, cut short, changed or
            unreadable, naming it.
        ValueError: The checkpoint holds what loading could run, or no model under ``model_key``.
    """
    path = Path(checkpoint)
    if not verify(path, collective=False):  # this process alone, as a distributed job's rank 0 may
        log.warning("The checkpoint %s has no manifest: its files cannot be verified.", path)
    if not path.is_dir():
        saved = load_file(path, weights_only=True)
        if not isinstance(saved.get(model_key), dict):
            raise _no_model(path, model_key)
        return dict(saved[model_key])
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{model_key}."
    metadata = SafeReader(path).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    if not state:
        raise _no_model(path, model_key)
    safe_load(state, path, no_dist=True)
    return {key.removeprefix(prefix): tensor for key, tensor in state.items()}


def _no_model(path: Path, model_key: str) -> ValueError:
    return ValueError(
        f"The checkpoint {path} holds no model under {model_key!r}: pass the key its model was saved "
        "under (model_key=…, --model-key): 'state_dict' for the Trainer's, the state's key for fabric.save."
    )


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    format: Format = "safetensors",
    module: nn.Module | None = None,
    model_key: str = MODEL_KEY,
) -> Path:
    """Write the model of ``checkpoint`` to ``output`` in ``format``.

    Args:
        checkpoint: A distributed checkpoint's folder (saved at any mesh) or a single file.
        output: The file to write (``safetensors``, ``torch``), or the folder (``transformers``).
        format: ``"safetensors"`` (one file, tensors by their names in the LightningModule),
            ``"torch"`` (the same dict in a ``torch.save`` file) or ``"transformers"`` (a folder
            with the model's config and ``model.safetensors``, which ``from_pretrained`` loads;
            tied weights stored once).
        module: For ``"transformers"``: the module that holds the ``transformers`` model, or the
            model itself (its weights are not used: it may live on the meta device).
        model_key: The key that holds the model: ``"state_dict"`` in ``Trainer``'s checkpoints,
            the model's key in the state given to ``fabric.save`` (``"model"`` in our examples).

    Returns:
        ``output``.

    Raises:
        ValueError: An unknown format, or ``"transformers"`` without a module that holds exactly
            one ``transformers`` model; a corrupt or unsafe checkpoint.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    output = Path(output)
    if format == "transformers":
        models = list(huggingface.transformers_models(module)) if module is not None else []
        if len(models) != 1:
            raise ValueError(
                "export_checkpoint(format='transformers') needs the module that holds one "
                "transformers model (module=…; from the command line, --config with its `model:`); "
                f"found {len(models)}."
            )
        weights = consolidated_weights(checkpoint, model_key)
        ((prefix, model),) = models
        own = (
            weights
            if not prefix
            else {
                key.removeprefix(f"{prefix}."): t
                for key, t in weights.items()
                if key.startswith(f"{prefix}.")
            }
        )
        model.save_pretrained(output, state_dict=own)
        return output
    weights = consolidated_weights(checkpoint, model_key)
    output.parent.mkdir(parents=True, exist_ok=True)
    if format == "safetensors":
        from safetensors.torch import save_file

        save_file({key: t.contiguous() for key, t in weights.items()}, output, metadata={"format": "pt"})
    else:
        torch.save(weights, output)
    return output


def main(argv: list[str] | None = None) -> None:
    """``canzona export``: the command line of `export_checkpoint`."""
    parser = argparse.ArgumentParser(
        prog="canzona export",
        description="Write a checkpoint's model as one safetensors or torch file, or a transformers folder.",
    )
    parser.add_argument("checkpoint", help="a distributed checkpoint's folder (any mesh) or a single file")
    parser.add_argument("output", help="the file to write, or the folder (--format transformers)")
    parser.add_argument("--format", choices=FORMATS, default="safetensors")
    parser.add_argument(
        "--config",
        help="the training config whose `model:` builds the LightningModule (on the meta device); "
        "needed for --format transformers",
    )
    parser.add_argument(
        "--model-key",
        default=MODEL_KEY,
        help="the key that holds the model: state_dict (Trainer) or the model's key in fabric.save's state",
    )
    arguments = parser.parse_args(argv)
    module = _module_from_config(arguments.config) if arguments.config else None
    written = export_checkpoint(
        arguments.checkpoint, arguments.output, arguments.format, module, arguments.model_key
    )
    print(f"lightning_canzona: wrote {written} ({arguments.format})")


def _module_from_config(config: str) -> nn.Module:
    """The LightningModule that a training config's ``model:`` describes: built on the meta device
    (no memory for weights), or on the CPU where its constructor must load weights (a
    ``from_pretrained`` refuses the meta device)."""
    from jsonargparse import ArgumentParser
    from lightning import LightningModule
    from omegaconf import OmegaConf

    described = OmegaConf.to_container(OmegaConf.load(config), resolve=True)
    parser = ArgumentParser()
    parser.add_subclass_arguments(LightningModule, "model", required=True)
    parsed = parser.parse_object({"model": described["model"]})
    try:
        with torch.device("meta"):
            return parser.instantiate_classes(parsed).model
    except Exception:  # only an optimization: on the CPU, a real error is raised as it is
        return parser.instantiate_classes(parsed).model
