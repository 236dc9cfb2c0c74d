"""Reading a checkpoint without trusting it.

A checkpoint may come from elsewhere (a download, a shared disk), so nothing in it may run code:

- a single file is unpickled with ``torch.load(weights_only=True)`` unless the caller asks
  otherwise (``Trainer.fit(weights_only=False)``);
- a distributed checkpoint's ``.metadata`` is a plain pickle, which torch's ``FileSystemReader``
  unpickles as it is, and the non-tensor values in it (param-group settings) are read by DCP's
  ``DefaultLoadPlanner`` with ``torch.load(weights_only=False)``: either can run any code.
  `SafeReader` first unpickles ``.metadata`` with `MetadataUnpickler`, which knows only the
  classes DCP's metadata is made of, and `SafePlanner` first loads each value with
  ``weights_only=True``; what they refuse never reaches the unrestricted readers
  (`UnsafeCheckpointError`).

A file that cannot be read — missing, cut short, damaged — is a `CorruptCheckpointError` naming
it, never the reader's own error: `load_file` for torch files, `SafeReader` for DCP's ``.metadata``
and each ``.distcp`` file (a missing file, or one shorter than the metadata says, is named before
DCP reads it).

Also here: the model's shapes and the optimizer record a checkpoint holds (`read_saved`), the
clear error for a checkpoint of another model (`check_compatible`), and the check that a
``ckpt_path`` exists (`check_path_exists`). Loading through them: `lightning_canzona.checkpoint.loading`.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.futures import Future

from lightning_canzona.checkpoint.errors import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
    corrupt,
    describe,
)
from lightning_canzona.checkpoint.swap import recover

#: Where a Trainer checkpoint keeps the model's tensors (Fabric's: under the key the user gave).
MODEL_KEY = "state_dict"
#: The file of a distributed checkpoint that Lightning writes everything else into.
LIGHTNING_METADATA = "meta.pt"
#: The key of the optimizer record (`lightning_canzona.checkpoint.identity`) in a checkpoint.
IDENTITY_KEY = "lightning_canzona"

#: ``ckpt_path`` values that Lightning resolves itself (``"registry…"`` too).
_NAMED_CHECKPOINTS = ("best", "last", "hpc")

#: What DCP's ``.metadata`` is made of: its dataclasses, and the torch and pathlib types they hold.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _Forbidden(pickle.UnpicklingError):
    """A checkpoint's pickle refers to something that loading it could run."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` and refuses every class it is not made of (`_METADATA_CLASSES`,
    torch dtypes): a crafted file cannot call anything else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise _Forbidden(f"{module}.{name}")


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader``, whose ``.metadata`` must first unpickle with `MetadataUnpickler`,
    and whose every failure to read a file is an error naming the file.

    Raises:
        UnsafeCheckpointError: ``.metadata`` refers to anything else (a crafted file: nothing of
            it ran).
        CorruptCheckpointError: ``.metadata`` or a ``.distcp`` file is missing, shorter than the
            metadata says, or cannot be read (naming the file).
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        try:
            MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except _Forbidden as refused:
            raise UnsafeCheckpointError(
                f"The checkpoint {self.path} was refused: its .metadata refers to {refused}, which "
                "a distributed checkpoint's metadata never holds, so loading it could run code. "
                "Nothing of it was run. Load only checkpoints from sources you trust."
            ) from None
        except FileNotFoundError:
            raise corrupt(self.path, ["its .metadata is missing"]) from None
        except Exception as error:
            raise corrupt(self.path, [f"its .metadata cannot be read ({describe(error)})"]) from None
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        """Read the plan's items file by file, each file first checked to hold them all."""
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            file = Path(self.path) / name
            try:
                _check_holds(file, [self.storage_data[item.storage_index] for item in items])
                super().read_data(replace(plan, items=items), planner).wait()
            except (CorruptCheckpointError, UnsafeCheckpointError):
                raise
            except Exception as error:
                raise corrupt(self.path, [f"{name} cannot be read ({describe(error)})"]) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _check_holds(file: Path, stored: list[Any]) -> None:
    """Raise the `CorruptCheckpointError` of a ``.distcp`` file that is missing or ends before
    the last of the ``stored`` items the metadata places in it."""
    if not file.is_file():
        raise corrupt(file.parent, [f"{file.name} is missing"])
    needed, size = max(info.offset + info.length for info in stored), file.stat().st_size
    if size < needed:
        cut = f"{file.name} is cut short: {size} bytes, where .metadata places data up to byte {needed}"
        raise corrupt(file.parent, [cut])


class SafePlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner``, whose non-tensor values must first load with
    ``torch.load(weights_only=True)`` (numbers, strings, containers of them)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as refused:
            raise UnsafeCheckpointError(
                f"A value of the checkpoint ({read_item.dest_index.fqn}) was refused: it is not "
                f"plain data, so loading it could run code ({str(refused).splitlines()[0]})."
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


@dataclass(frozen=True)
class Saved:
    """What `read_saved` finds in a checkpoint.

    Attributes:
        shapes: The global shape of every model tensor, by name.
        identity: The optimizer record (`lightning_canzona.checkpoint.identity`), or ``None`` in
            a checkpoint saved without one.
    """

    shapes: dict[str, tuple[int, ...]]
    identity: dict[str, Any] | None = field(default=None)


def read_saved(path: Path, weights_only: bool | None = None, model_key: str = MODEL_KEY) -> Saved:
    """The model's shapes and the optimizer record in a Lightning checkpoint (a folder or a file),
    the model's tensors being under ``model_key``.

    A single file is unpickled with ``weights_only`` (``None``: ``True``, as ``torch.load`` does),
    a distributed checkpoint's ``.metadata`` by `SafeReader`, so that a checkpoint from elsewhere
    runs no code unless the caller asks for full unpickling.

    Raises:
        CorruptCheckpointError: A file it reads is missing or cannot be read, naming it.
    """
    weights_only = True if weights_only is None else weights_only
    prefix = model_key + "."
    if path.is_dir():
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = SafeReader(path).read_metadata().state_dict_metadata
        shapes = {
            key.removeprefix(prefix): tuple(entry.size)
            for key, entry in metadata.items()
            if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
        }
        lightning = path / LIGHTNING_METADATA
        rest = load_file(lightning, weights_only, path) if lightning.is_file() else {}
        return Saved(shapes, rest.get(IDENTITY_KEY))
    checkpoint = load_file(path, weights_only)
    shapes = {key: tuple(value.shape) for key, value in checkpoint.get(model_key, {}).items()}
    return Saved(shapes, checkpoint.get(IDENTITY_KEY))


def load_file(file: Path, weights_only: bool | None, checkpoint: Path | None = None) -> Any:
    """``torch.load`` of ``file`` (a single-file checkpoint, or the file ``meta.pt`` of the
    distributed ``checkpoint``) on the CPU, memory-mapped.

    Raises:
        CorruptCheckpointError: ``file`` is missing or cannot be read, naming it.
        pickle.UnpicklingError: torch's weights-only unpickler refused a class it names (a file
            from elsewhere that is whole; nothing of it ran), as ``torch.load`` raises it.
    """
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=weights_only)
    except FileNotFoundError:
        raise corrupt(checkpoint or file, [f"{file.name} is missing"]) from None
    except Exception as error:
        if isinstance(error, pickle.UnpicklingError) and "Unsupported global" in str(error):
            raise
        problem = (
            f"{file.name} cannot be read ({describe(error)})"
            if zipfile.is_zipfile(file)
            else f"{file.name} is not a whole zip archive, as torch saves one"
        )
        raise corrupt(checkpoint or file, [problem]) from None


def check_compatible(
    path: Path,
    expected: Mapping[str, tuple[int, ...]],
    strict: bool = True,
    listed: int = 5,
    weights_only: bool | None = None,
    saved: Saved | None = None,
    partial_load: str = "set `strict_loading = False` on the LightningModule",
) -> None:
    """Raise a `ValueError` naming what differs when ``path`` holds another model's weights.

    Args:
        path: The checkpoint (a distributed checkpoint folder or a single file).
        expected: The global shape of each tensor of the model's state dict.
        strict: Whether missing or unexpected tensors count as differences (Lightning's
            ``strict_loading``); differing shapes always do.
        listed: How many names of each kind the message lists.
        weights_only: How a single file is unpickled (see `read_saved`).
        saved: What `read_saved` found, if it was read already.
        partial_load: How the caller loads part of a model (named in the message).
    """
    shapes = (saved or read_saved(path, weights_only)).shapes
    reshaped = [name for name, shape in expected.items() if name in shapes and shapes[name] != shape]
    problems = [
        f"{name!r} has shape {shapes[name]} in the checkpoint but {expected[name]} in the model"
        for name in reshaped[:listed]
    ]
    if len(reshaped) > listed:
        problems.append(f"{len(reshaped) - listed} more tensors have other shapes")
    if strict:
        missing = [name for name in expected if name not in shapes]
        unexpected = [name for name in shapes if name not in expected]
        for names, what in ((missing, "missing from the checkpoint"), (unexpected, "not in the model")):
            if names:
                more = f" and {len(names) - listed} more" if len(names) > listed else ""
                problems.append(f"{len(names)} tensors {what}: {names[:listed]}{more}")
    if problems:
        raise ValueError(
            f"The checkpoint {path} holds a different model: {'; '.join(problems)}. "
            "Resume from a checkpoint of this model (the same architecture and preset); to load "
            f"a checkpoint holding only part of the model, {partial_load}."
        )


def safe_load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``path`` through `SafeReader` and
    `SafePlanner` (collective, unless ``no_dist``: this process alone); their errors
    (`CorruptCheckpointError`, `UnsafeCheckpointError`) are raised as they are, on every rank,
    not inside DCP's ``CheckpointException``, which gathers every rank's failure."""
    from torch.distributed.checkpoint import CheckpointException, load

    try:
        with warnings.catch_warnings():
            # DCP says it assumes a single process even when asked for one (no_dist=True).
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
            load(state, storage_reader=SafeReader(path), planner=SafePlanner(), no_dist=no_dist)
    except CheckpointException as failed:
        ours = [
            error
            for _, (error, _) in sorted(failed.failures.items())
            if isinstance(error, (CorruptCheckpointError, UnsafeCheckpointError))
        ]
        if ours:
            raise ours[0] from None
        raise


def check_path_exists(path: str | os.PathLike | None, setting: str) -> None:
    """Raise a `FileNotFoundError` naming ``setting`` when ``path`` is a local path with nothing at it.

    A checkpoint that an interrupted swap left beside ``path`` is put back first
    (`lightning_canzona.checkpoint.swap.recover`). ``None``, Lightning's names (``"best"``,
    ``"last"``, ``"hpc"``, ``"registry…"``) and remote URLs (``s3://…``) are left to Lightning.
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
    recover(local)
    if not local.exists():
        where = "" if local.is_absolute() else f" (looked for {local.absolute()})"
        raise FileNotFoundError(
            f"{setting}={text!r} does not exist{where}. Pass the path of a checkpoint file or of a "
            "distributed checkpoint's folder, 'last', or None to start from scratch."
        )


__all__ = [
    "IDENTITY_KEY",
    "LIGHTNING_METADATA",
    "MetadataUnpickler",
    "SafePlanner",
    "SafeReader",
    "Saved",
    "check_compatible",
    "check_path_exists",
    "load_file",
    "read_saved",
    "safe_load",
]
