"""Checkpoint pieces of `CanzonaStrategy` that Lightning's `ModelParallelStrategy` lacks.

- every owner's matrix state in a single-file checkpoint (`full_optimizer_state`), and in a
  distributed one teams' state whole and a stack's failure count whole
  (`distributed_optimizer_state`);
- saves that never destroy the last good checkpoint: written beside it, swapped in when every
  rank is done (`staging_path`, `replace_with`);
- a clear error, before any state is touched, for a checkpoint of another model
  (`check_compatible`), and before any rank starts for one that does not exist
  (`check_path_exists`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_canzona.optim import MatrixOptimizer
from lightning_canzona.rules.base import FAILURES

#: Where a distributed checkpoint keeps the model's tensors (Lightning saves ``state_dict``).
_MODEL_PREFIX = "state_dict."


def full_optimizer_state(module: nn.Module, optimizer: MatrixOptimizer) -> dict[str, Any]:
    """The whole optimizer state on rank 0, keyed by parameter name (collective).

    Sharded state is gathered by ``get_optimizer_state_dict(full_state_dict=True)``; the matrix
    state that lives only on each matrix's owner (or in slices on a team's members) is gathered
    from the owners.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    names = {id(param): name for name, param in module.named_parameters()}
    with optimizer.whole_team_state():
        state_dict = get_optimizer_state_dict(module, optimizer, options=options)
        held = {
            names[id(param)]: {key: value.cpu() for key, value in matrix_state.items()}
            for param, matrix_state in optimizer.owner_held_state()
        }
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    everyone: list[Any] = [None] * world if rank == 0 else []
    torch.distributed.gather_object(held, everyone if rank == 0 else None, dst=0)
    counts: dict[str, torch.Tensor] = {}
    for owned in everyone:
        for name, matrix_state in owned.items():
            state_dict["state"].setdefault(name, {}).update(matrix_state)
            if FAILURES in matrix_state:  # a stack's matrices' owners each count their own
                counts[name] = counts.get(name, 0) + matrix_state[FAILURES]
    for name, count in counts.items():
        state_dict["state"][name][FAILURES] = count
    return state_dict


def distributed_optimizer_state(module: nn.Module, optimizer: MatrixOptimizer) -> dict[str, Any]:
    """This rank's part of the optimizer state for a distributed checkpoint (collective).

    Each rank's part holds the matrix state of the matrices it owns, a team's whole on its first
    member (loadable at any mesh and plan). A stack's matrices have owners on several ranks,
    each counting its own failed decompositions under the stack's one key, which the checkpoint
    saves once: each owner's part holds the total (as `full_optimizer_state` does), and a load
    leaves it with one owner (`MeshEngine.keep_loaded_stack_failures_on_one_owner`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=False, cpu_offload=True)
    with optimizer.whole_team_state():
        state_dict = get_optimizer_state_dict(module, optimizer, options=options)
    stacks = [name for name, param in module.named_parameters() if param.ndim == 3]
    if stacks:  # the same on every rank: the model's
        counts = torch.tensor(
            [int(state_dict["state"].get(name, {}).get(FAILURES, 0)) for name in stacks], dtype=torch.int64
        )
        torch.distributed.all_reduce(counts)
        for name, count in zip(stacks, counts):
            if FAILURES in state_dict["state"].get(name, {}):
                state_dict["state"][name][FAILURES] = count.clone()
    return state_dict


#: ``ckpt_path`` values that Lightning resolves itself (``"registry…"`` too).
_NAMED_CHECKPOINTS = ("best", "last", "hpc")


def check_path_exists(path: str | os.PathLike | None, setting: str) -> None:
    """Raise a `FileNotFoundError` naming ``setting`` when ``path`` is a local path with nothing at it.

    ``None``, Lightning's names (``"best"``, ``"last"``, ``"hpc"``, ``"registry…"``) and remote
    URLs (``s3://…``) are left to Lightning.
    """
    if path is None:
        return
    text = os.fspath(path)
    if (
        text in _NAMED_CHECKPOINTS
        or text.startswith("registry")
        or ("://" in text and not text.startswith("file://"))
    ):
        return
    local = Path(text.removeprefix("file://"))
    if not local.exists():
        where = "" if local.is_absolute() else f" (looked for {local.absolute()})"
        raise FileNotFoundError(
            f"{setting}={text!r} does not exist{where}. Pass the path of a checkpoint file or of a "
            "distributed checkpoint's folder, 'last', or None to start from scratch."
        )


def staging_path(path: Path) -> Path:
    """Where a checkpoint for ``path`` is written before it replaces ``path``."""
    return path.with_name(f".{path.name}.partial")


def remove(path: Path) -> None:
    """Delete a checkpoint file or folder, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def replace_with(staged: Path, path: Path) -> None:
    """Put the fully written ``staged`` checkpoint at ``path``.

    A file replaces a file atomically. A folder (a distributed checkpoint) cannot replace a
    non-empty folder in one step: the old one is moved aside first and deleted last, so at every
    moment one complete checkpoint exists under ``path`` or its ``.old`` neighbour.
    """
    if staged.is_file() and not path.is_dir():
        os.replace(staged, path)
        return
    previous = path.with_name(f".{path.name}.old")
    remove(previous)
    if path.exists() or path.is_symlink():
        os.replace(path, previous)
    os.replace(staged, path)
    remove(previous)


def saved_model_shapes(path: Path, weights_only: bool | None = None) -> dict[str, tuple[int, ...]]:
    """The global shape of every model tensor in a Lightning checkpoint (a folder or a file).

    A single file is unpickled with ``weights_only`` (``None``: ``True``, as ``torch.load`` does),
    so a checkpoint from elsewhere cannot run code unless the caller asks for full unpickling.
    """
    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        return {
            key.removeprefix(_MODEL_PREFIX): tuple(entry.size)
            for key, entry in metadata.items()
            if key.startswith(_MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
        }
    weights_only = True if weights_only is None else weights_only
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    return {key: tuple(value.shape) for key, value in checkpoint["state_dict"].items()}


def check_compatible(
    path: Path,
    expected: Mapping[str, tuple[int, ...]],
    strict: bool = True,
    listed: int = 5,
    weights_only: bool | None = None,
) -> None:
    """Raise a `ValueError` naming what differs when ``path`` holds another model's weights.

    Args:
        path: The checkpoint (a distributed checkpoint folder or a single file).
        expected: The global shape of each tensor of the model's state dict.
        strict: Whether missing or unexpected tensors count as differences (Lightning's
            ``strict_loading``); differing shapes always do.
        listed: How many names of each kind the message lists.
        weights_only: How a single file is unpickled (see `saved_model_shapes`).
    """
    saved = saved_model_shapes(path, weights_only)
    reshaped = [name for name, shape in expected.items() if name in saved and saved[name] != shape]
    problems = [
        f"{name!r} has shape {saved[name]} in the checkpoint but {expected[name]} in the model"
        for name in reshaped[:listed]
    ]
    if len(reshaped) > listed:
        problems.append(f"{len(reshaped) - listed} more tensors have other shapes")
    if strict:
        missing = [name for name in expected if name not in saved]
        unexpected = [name for name in saved if name not in expected]
        for names, what in ((missing, "missing from the checkpoint"), (unexpected, "not in the model")):
            if names:
                more = f" and {len(names) - listed} more" if len(names) > listed else ""
                problems.append(f"{len(names)} tensors {what}: {names[:listed]}{more}")
    if problems:
        raise ValueError(
            f"The checkpoint {path} holds a different model: {'; '.join(problems)}. "
            "Resume from a checkpoint of this model (the same architecture and preset); to load "
            "a checkpoint holding only part of the model, set `strict_loading = False` on the "
            "LightningModule."
        )
