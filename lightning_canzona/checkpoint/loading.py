"""Loading a checkpoint at any mesh, for both strategies, after checking it on every rank.

`check_before_loading` puts back a checkpoint that a crash left beside its name, verifies its
files against what was saved, reads what it holds, and checks its model's shapes and its
optimizers against this run's: each problem is the same error on every rank before any state is
touched (`lightning_canzona.checkpoint.errors.on_every_rank`). `load_distributed` then loads a
distributed checkpoint through the readers that run no code and name a file they cannot read
(`lightning_canzona.checkpoint.reading`), every owner's matrix state going to the matrix's owner
under this run's plan; DCP gathers each rank's failure to read, so it too is an error on every
rank. `load_single_file` loads Fabric's single file, read whole on every rank: each keeps its
part of the sharded state and, of the matrix state, what this run's plan gives it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_canzona.checkpoint.errors import corrupt, on_every_rank
from lightning_canzona.checkpoint.identity import check_same_optimizers
from lightning_canzona.checkpoint.integrity import verify
from lightning_canzona.checkpoint.reading import (
    LIGHTNING_METADATA,
    MODEL_KEY,
    Saved,
    check_compatible,
    load_file,
    read_saved,
    safe_load,
)
from lightning_canzona.checkpoint.swap import recover
from lightning_canzona.optim import MatrixOptimizer


def check_before_loading(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strict: bool,
    verify_files: bool,
    weights_only: bool | None = None,
    model_key: str = MODEL_KEY,
    partial_load: str = "set `strict_loading = False` on the LightningModule",
) -> Saved:
    """Every check of the checkpoint at ``path`` before anything loads (collective); returns what
    `read_saved` found. ``optimizers``: those whose state will be loaded (checked to be the
    checkpoint's); ``verify_files``: check the files against the manifest (a checkpoint without
    one is loaded with a warning).

    Raises:
        CorruptCheckpointError: A file is missing, cut short, changed (``verify_files``) or
            cannot be read, naming it.
        ValueError: The checkpoint holds another model or another optimizer's state.
    """
    # Put back a swap interrupted by a crash; the gather is the barrier before anyone reads.
    on_every_rank(lambda: dist.get_rank() == 0 and recover(path))
    if verify_files and not verify(path) and dist.get_rank() == 0:
        warnings.warn(
            f"The checkpoint {path} has no manifest (it was saved by an earlier version of "
            "lightning_canzona or by another strategy): its files cannot be verified.",
            UserWarning,
            stacklevel=3,
        )

    def read_and_compare() -> Saved:
        if path.is_dir() and not (path / LIGHTNING_METADATA).is_file():  # Lightning writes it last
            raise corrupt(path, [f"{LIGHTNING_METADATA} is missing"])
        saved = read_saved(path, weights_only, model_key)
        expected = {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}
        check_compatible(path, expected, strict=strict, saved=saved, partial_load=partial_load)
        if optimizers:
            check_same_optimizers(saved.identity, optimizers, path)
        return saved

    return on_every_rank(read_and_compare)


def check_file_before_launch(path: Path, verify_files: bool) -> None:
    """Check a single-file checkpoint that the launching process reads before any rank starts
    (LightningCLI reads its hyperparameters): its records against its zip directory
    (``verify_files``), then that torch can read it as the ranks will.

    Raises:
        CorruptCheckpointError: The file is cut short, changed or unreadable, naming it.
    """
    if verify_files:
        verify(path, collective=False)
    read_saved(path)


def load_distributed(
    path: Path,
    module: nn.Module,
    optimizers: Mapping[str, Optimizer],
    strict: bool = True,
    weights_only: bool | None = None,
    model_key: str = MODEL_KEY,
) -> dict[str, Any]:
    """Load a distributed checkpoint into ``module`` (its tensors under ``model_key``) and
    ``optimizers`` (each under its key); returns the rest it holds (``meta.pt``). Collective.

    ``optimizers`` may be empty (the weights only).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    for optimizer in optimizers.values():
        if isinstance(optimizer, MatrixOptimizer) and optimizer.splits_matrix_state():
            # DCP loads into tensors of the saved shapes: a team's state must be whole on its
            # first member (`load_state_dict` hands out the slices). Getting the state dict first
            # creates the state of an optimizer that never stepped.
            get_optimizer_state_dict(module, optimizer)
            optimizer.gather_team_state()
    model_state = {model_key: get_model_state_dict(module)}
    safe_load(model_state, path)
    module.load_state_dict(model_state[model_key], strict=strict)
    for key, optimizer in optimizers.items():
        state = {key: get_optimizer_state_dict(module, optimizer)}
        safe_load(state, path)
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state[key], options=options)
    weights_only = True if weights_only is None else weights_only
    return load_file(path / LIGHTNING_METADATA, weights_only, path)


def load_single_file(
    path: Path,
    module: nn.Module,
    module_key: str,
    optimizers: Mapping[str, Optimizer],
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a single-file checkpoint of Fabric's layout (whole tensors, optimizer state by
    parameter name) into ``module`` and ``optimizers``; returns the rest it holds. Collective."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights_only = True if weights_only is None else weights_only
    checkpoint = load_file(path, weights_only)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop(module_key), options=options)
    for key, optimizer in optimizers.items():
        state = _local_optimizer_state(module, optimizer, checkpoint.pop(key))
        local = StateDictOptions(strict=strict)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=local)
    return checkpoint


def _local_optimizer_state(module: nn.Module, optimizer: Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """The whole optimizer state ``saved``, which every rank read, as this rank loads it
    (collective where the optimizer has no state yet: getting its state dict creates it).

    Each tensor that this rank's state holds as a DTensor (momenta, Adam's moments) becomes this
    rank's part of it; the rest stays whole, every owner's matrix state and the counters, of which
    `MatrixOptimizer.load_state_dict` keeps what this run's plan gives this rank, at any mesh.

    Not ``set_optimizer_state_dict(full_state_dict=True)``: it assumes that every rank's state has
    the same keys, and a counter of ``saved`` that this rank's state lacks (the step of a matrix
    owned elsewhere, ``stack{m}_step`` of a stack's) loses its path in the state dict it flattens,
    a ``KeyError`` when it unflattens it.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    held = get_optimizer_state_dict(module, optimizer)["state"]
    state = {
        name: {
            key: _part_like(value, held[name][key])
            if isinstance(held.get(name, {}).get(key), DTensor)
            else value
            for key, value in param_state.items()
        }
        for name, param_state in saved["state"].items()
    }
    return {**saved, "state": state}


def _part_like(whole: Tensor, like: DTensor) -> DTensor:
    """This rank's part of ``whole``, placed as ``like``, in memory of its own (no collective: every
    rank holds ``whole``)."""
    mesh, placements = like.device_mesh, like.placements
    part = distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()
    # A shard is a view of the whole, which would stay alive with it.
    return DTensor.from_local(part.clone(), mesh, placements, shape=like.shape, stride=like.stride())
