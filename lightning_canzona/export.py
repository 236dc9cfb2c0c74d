"""A checkpoint as files that other tools read: the whole model in one ``safetensors`` or torch
file, or a Hugging Face ``transformers`` directory that ``from_pretrained`` loads.

A distributed checkpoint, saved at any mesh, is consolidated in this process by DCP itself: each
model tensor is read whole, from whichever shards hold it, into one full copy of the weights in
host memory (the optimizer's state is left out). The checkpoint is verified first
(`lightning_canzona.checkpoint.integrity`) and read without running any of its code
(`lightning_canzona.checkpoint.reading`).

``canzona export CHECKPOINT OUTPUT [--format …] [--config CONFIG] [--model-key KEY]`` runs
`export_checkpoint` from the command line (`lightning_canzona.tools.export`).
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_canzona import huggingface
from lightning_canzona.checkpoint.integrity import verify
from lightning_canzona.checkpoint.reading import LIGHTNING_METADATA, SafeReader, load_file, safe_load

log = logging.getLogger(__name__)

Format = Literal["safetensors", "torch", "transformers"]
FORMATS: tuple[Format, ...] = ("safetensors", "torch", "transformers")


def consolidated_weights(checkpoint: str | Path, model_key: str | None = None) -> dict[str, Tensor]:
    """Every model tensor of a Lightning checkpoint, whole, on the CPU, by its name in the
    model's state dict.

    Args:
        checkpoint: A distributed checkpoint's folder (saved at any mesh) or a single file.
        model_key: The key that holds the model: ``"state_dict"`` in ``Trainer``'s checkpoints,
            the model's key in the state given to ``fabric.save``. ``None``: the one key that
            holds a model's tensors (an optimizer's are not a model's).

    Raises:
        CorruptCheckpointError: A file of the checkpoint is missing, cut short, changed or
            unreadable, naming it.
        ValueError: The checkpoint holds what loading could run, holds no model under
            ``model_key``, or (``model_key=None``) no model or several.
    """
    path = Path(checkpoint)
    _verify(path)
    return _read_weights(path, model_key)


def _verify(path: Path) -> None:
    if not verify(path, collective=False):  # this process alone, as a distributed job's rank 0 may
        log.warning("The checkpoint %s has no manifest: its files cannot be verified.", path)


def _read_weights(path: Path, model_key: str | None) -> dict[str, Tensor]:
    """`consolidated_weights` of a verified checkpoint."""
    if not path.is_dir():
        saved = load_file(path, weights_only=True)
        models = [key for key, value in saved.items() if _is_state_dict(value)]
        return dict(saved[_model_key(path, model_key, models)])
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeReader(path).read_metadata().state_dict_metadata
    optimizers = {key.split(".", 1)[0] for key in metadata if ".param_groups." in key}
    tensors = {key: entry for key, entry in metadata.items() if isinstance(entry, TensorStorageMetadata)}
    models = sorted({key.split(".", 1)[0] for key in tensors} - optimizers)
    prefix = f"{_model_key(path, model_key, models)}."
    state = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in tensors.items()
        if key.startswith(prefix)
    }
    safe_load(state, path, no_dist=True)
    return {key.removeprefix(prefix): tensor for key, tensor in state.items()}


def _is_state_dict(value: object) -> bool:
    """Whether ``value`` (of a single-file checkpoint) is a module's state dict: tensors by name,
    not an optimizer's ``state`` and ``param_groups``."""
    return isinstance(value, dict) and any(isinstance(t, Tensor) for t in value.values())


def _model_key(path: Path, given: str | None, models: list[str]) -> str:
    """``given``, or the one key among ``models`` (the keys that hold a model's tensors)."""
    if given in models or (given is None and len(models) == 1):
        return models[0] if given is None else given
    if not models:
        under = "" if given is None else f" (none under {given!r})"
        raise ValueError(f"The checkpoint {path} holds no model's tensors{under}.")
    if len(models) == 1:
        (model,) = models
        held = f"its model is under {model!r}: pass model_key={model!r} (--model-key {model}) or none"
    else:
        held = f"it holds models under {models}: pass the key of the one to export (model_key=…, --model-key)"
    missing = "holds several models" if given is None else f"holds no model under {given!r}"
    raise ValueError(f"The checkpoint {path} {missing}: {held}.")


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    format: Format = "safetensors",
    module: nn.Module | None = None,
    model_key: str | None = None,
) -> Path:
    """Write the model of ``checkpoint`` to ``output`` in ``format``.

    Args:
        checkpoint: A distributed checkpoint's folder (saved at any mesh) or a single file.
        output: The file to write (``safetensors``, ``torch``), or the folder (``transformers``).
        format: ``"safetensors"`` (one file, tensors by their names in the LightningModule),
            ``"torch"`` (the same dict in a ``torch.save`` file) or ``"transformers"`` (a folder
            with the model's config and ``model.safetensors`` by the ``transformers`` model's own
            names, which ``from_pretrained`` loads; tied weights stored once).
        module: For ``"transformers"``: the module that holds the ``transformers`` model, or the
            model itself (its weights are not used: it may live on the meta device). ``None``:
            the LightningModule that a ``Trainer`` checkpoint's hyperparameters name (saved by
            ``save_hyperparameters`` in a module that ``canzona fit`` built), on the meta device.
        model_key: The key that holds the model: ``"state_dict"`` in ``Trainer``'s checkpoints,
            the model's key in the state given to ``fabric.save`` (``"model"`` in our examples);
            ``None``: the one key that holds a model.

    Returns:
        ``output``.

    Raises:
        ValueError: An unknown format; for ``"transformers"``, no module that holds exactly one
            ``transformers`` model, or a model whose tensors the checkpoint does not hold; a
            corrupt or unsafe checkpoint, or one without one model (see `consolidated_weights`).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    path, output = Path(checkpoint), Path(output)
    _verify(path)
    if format == "transformers":  # the model first: no reading of weights that cannot be written
        name, model = _the_transformers_model(
            module if module is not None else _module_from_hyperparameters(path), path, output
        )
        own = _weights_of(model, _read_weights(path, model_key), name, path)
        model.save_pretrained(output, state_dict=own)
        for written in output.glob("*.safetensors"):
            readable_as_created(written)
        return output
    weights = _read_weights(path, model_key)
    output.parent.mkdir(parents=True, exist_ok=True)
    if format == "safetensors":
        from safetensors.torch import save_file

        save_file({key: t.contiguous() for key, t in weights.items()}, output, metadata={"format": "pt"})
        readable_as_created(output)
    else:
        torch.save(weights, output)
    return output


def readable_as_created(path: Path) -> None:
    """Give a file that safetensors wrote the permissions of one that ``open`` creates (0666 less
    the umask): safetensors writes its files readable by their owner only (0600), which a team's
    shared model folder, a serving process of another user or a container could not read."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _the_transformers_model(
    module: nn.Module | None, checkpoint: str | Path, output: Path
) -> tuple[str, nn.Module]:
    """The one ``transformers`` model in ``module`` and its name there, or a `ValueError` saying
    what to pass."""
    if module is None:
        raise ValueError(
            f"Exporting {checkpoint} as a transformers folder needs the module that holds the "
            "transformers model, which the checkpoint does not name: pass --config with its training "
            f"config, or in Python lc.export_checkpoint({str(checkpoint)!r}, {str(output)!r}, "
            "'transformers', module=model) with the LightningModule or the transformers model. A "
            "model that is not a transformers model (the bundled Qwen3 among them) has no such folder: "
            "export it as one file, --format safetensors (the default) or --format torch."
        )
    models = list(huggingface.transformers_models(module))
    if not models:
        raise ValueError(
            f"{type(module).__name__} holds no transformers model, so there is no transformers "
            "folder to write: export the checkpoint as one file, format='safetensors' (the "
            "default) or 'torch' (--format safetensors, --format torch)."
        )
    if len(models) > 1:
        raise ValueError(
            f"{type(module).__name__} holds {len(models)} transformers models "
            f"({[name for name, _ in models]}): pass the one to export as module=… (in Python)."
        )
    return models[0]


def _weights_of(
    model: nn.Module, weights: dict[str, Tensor], name: str, checkpoint: str | Path
) -> dict[str, Tensor]:
    """``model``'s tensors among ``weights``, by its own names: under the prefix that holds
    every tensor of its state dict with its shape (``"model."`` in a Trainer checkpoint of a
    LightningModule's ``self.model``, ``""`` in a Fabric checkpoint of the model itself) — its
    ``name`` in the module given, where several do.

    Raises:
        ValueError: No prefix holds them all, or several do and its name is none of them.
    """
    shapes = {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}
    anchor = next(iter(shapes))
    prefixes = [key.removesuffix(anchor) for key in weights if key == anchor or key.endswith(f".{anchor}")]
    placed = [
        prefix
        for prefix in prefixes
        if all(
            prefix + key in weights and tuple(weights[prefix + key].shape) == s for key, s in shapes.items()
        )
    ]
    given = f"{name}." if name else ""
    if len(placed) == 1 or given in placed:
        prefix = given if given in placed else placed[0]
        # Weights that the model ties, and the checkpoint holds equal, as one tensor: save_pretrained
        # then stores them once. Tied weights that training changed apart are written as trained.
        parameters = model.state_dict(keep_vars=True)
        first: dict[int, str] = {}
        own: dict[str, Tensor] = {}
        for key in shapes:
            tensor, tied_to = weights[prefix + key], first.setdefault(id(parameters[key]), key)
            own[key] = own[tied_to] if tied_to != key and torch.equal(own[tied_to], tensor) else tensor
        return own
    kind = type(model).__name__
    if not placed:
        raise ValueError(
            f"The checkpoint {checkpoint} does not hold the weights of this {kind}: no prefix holds "
            f"all {len(shapes)} tensors of its state dict with their shapes (such as {anchor!r} "
            f"{shapes[anchor]}). Pass the module of the run that saved it."
        )
    raise ValueError(
        f"The checkpoint {checkpoint} holds {kind}'s tensors under {len(placed)} prefixes "
        f"({placed}): pass the LightningModule that holds the one to export as module=…."
    )


def _module_from_hyperparameters(checkpoint: str | Path) -> nn.Module | None:
    """The LightningModule that a ``Trainer`` checkpoint's hyperparameters name (a module that
    ``canzona fit`` built saves its class path with them), built on the meta device; None for a
    checkpoint that names none. The hyperparameters are read with ``weights_only=True``."""
    path = Path(checkpoint)
    saved = path / LIGHTNING_METADATA if path.is_dir() else path
    if not saved.is_file():
        return None
    try:
        hyperparameters = load_file(saved, weights_only=True).get("hyper_parameters")
    except pickle.UnpicklingError:  # hyperparameters that only full unpickling reads: none for us
        return None
    if not isinstance(hyperparameters, dict) or "_class_path" not in hyperparameters:
        return None
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import instantiate_module
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    hyperparameters = {key: value for key, value in hyperparameters.items() if key != "_instantiator"}
    rank_zero_info(
        f"lightning_canzona: building {hyperparameters['_class_path']} from the checkpoint's "
        "hyperparameters, on the meta device"
    )
    return _on_meta_device(lambda: instantiate_module(LightningModule, hyperparameters))


def module_from_config(config: str | Path) -> nn.Module:
    """The LightningModule that a training config's ``model:`` describes, built on the meta device
    where it can be (`_on_meta_device`): what ``canzona export --config`` exports."""
    from jsonargparse import ArgumentParser
    from lightning import LightningModule
    from omegaconf import OmegaConf

    described = OmegaConf.to_container(OmegaConf.load(config), resolve=True)
    parser = ArgumentParser()
    parser.add_subclass_arguments(LightningModule, "model", required=True)
    parsed = parser.parse_object({"model": described["model"]})
    return _on_meta_device(lambda: parser.instantiate_classes(parsed).model)


def _on_meta_device(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the meta device (no memory for weights), or on the CPU where its
    constructor must load weights (a ``from_pretrained`` refuses the meta device)."""
    try:
        with torch.device("meta"):
            return build()
    except Exception:  # only an optimization: on the CPU, a real error is raised as it is
        return build()
