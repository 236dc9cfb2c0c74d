"""Saving a checkpoint without risking the last good one, for both strategies.

`save_atomically` writes the new checkpoint beside ``path``, gives a distributed one its manifest
once every rank has written its part, and swaps it in (`lightning_canzona.checkpoint.swap`); a
save that fails on any rank raises on every rank and leaves ``path`` as it was. What is written is
the caller's: Lightning's Trainer layout (`CanzonaStrategy`) or Fabric's (`write_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_canzona.checkpoint.integrity import write_manifest
from lightning_canzona.checkpoint.reading import LIGHTNING_METADATA
from lightning_canzona.checkpoint.state import distributed_optimizer_state, full_optimizer_state
from lightning_canzona.checkpoint.swap import remove, replace_with, staging_path
from lightning_canzona.optim import MatrixOptimizer


def save_atomically(
    path: Path, write: Callable[[Path], None], distributed: bool, device: torch.device
) -> None:
    """``write`` the checkpoint to a staging path beside ``path`` on every rank, then swap it in.

    Collective. ``distributed``: the checkpoint is a folder of every rank's parts, which gets a
    manifest (`integrity.write_manifest`) once all are on disk.

    Raises:
        Exception: What ``write`` or the manifest raised on this rank, or a `RuntimeError` saying
            that another rank failed; on every rank, with ``path`` unchanged.
    """
    from torch.distributed.checkpoint import CheckpointException

    staged = staging_path(path)
    rank = dist.get_rank()
    if rank == 0:
        remove(staged)
    dist.barrier()
    error: BaseException | None = None
    try:
        write(staged)
    # Every rank must learn of a failure before anyone moves on (DCP's error is a BaseException).
    except (Exception, CheckpointException) as exception:
        error = exception
    failed = _on_any_rank(error is not None, device)
    if not failed and distributed:  # every part is on disk, the metadata too
        problem = write_manifest(staged)
        error = OSError(f"Writing the manifest of {path} failed: {problem}") if problem else None
        # Rank 0 alone writes the file: only it learns that writing it failed.
        failed = _on_any_rank(error is not None, device)
    if failed:
        if rank == 0:
            remove(staged)
        dist.barrier()  # no rank ends the run before the partial checkpoint is gone
        raise error or RuntimeError(
            f"Saving the checkpoint {path} failed on another rank (its error is in that rank's "
            f"log); {path} still holds the previous checkpoint."
        )
    if rank == 0:
        replace_with(staged, path)
    dist.barrier()


def write_state(path: Path, state: dict[str, Any], module: nn.Module, distributed: bool) -> None:
    """Write ``state`` in Lightning Fabric's layout (collective): its modules' and optimizers'
    state dicts — a distributed checkpoint (a folder, each rank its part, the rest in
    ``meta.pt``) or a single file written by rank 0 — with every owner's matrix state
    (`lightning_canzona.checkpoint.state`). ``module`` is the model the optimizers update."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=not distributed, cpu_offload=True)
    tensors: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            tensors[key] = get_model_state_dict(value, options=options)
        elif isinstance(value, MatrixOptimizer):
            owners = distributed_optimizer_state if distributed else full_optimizer_state
            tensors[key] = owners(module, value)
        elif isinstance(value, Optimizer):
            tensors[key] = get_optimizer_state_dict(module, value, options=options)
        else:
            metadata[key] = value
    if distributed:
        save(tensors, checkpoint_id=path)
        if dist.get_rank() == 0:
            torch.save(metadata, path / LIGHTNING_METADATA)
    elif dist.get_rank() == 0:
        torch.save({**tensors, **metadata}, path)


def _on_any_rank(flag: bool, device: torch.device) -> bool:
    value = torch.tensor(int(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value)
