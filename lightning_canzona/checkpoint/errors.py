"""What a checkpoint that cannot be loaded raises, through every door, on every rank.

- `CorruptCheckpointError`: a file of the checkpoint is missing, cut short, changed or cannot be
  read; the message names the checkpoint and the file (`corrupt`).
- `UnsafeCheckpointError`: the checkpoint holds what loading it could run; nothing of it ran.

Both are ``ValueError``s. `on_every_rank` makes the failure of one rank's part of a check (or of
a save) the same error on every rank, at a point every rank reaches, instead of a rank raising
alone while the others wait in their next collective until the process group's timeout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")

_FIRST_SENTENCE = re.compile(r"(?<=\.) ")


class CorruptCheckpointError(ValueError):
    """A file of a checkpoint is missing, cut short, changed since it was saved, or unreadable."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something that loading it could run (nothing of it was run)."""


#: What another rank's failure is raised as, by its type's name; anything else: a RuntimeError.
_SAME_ON_EVERY_RANK = {
    kind.__name__: kind for kind in (CorruptCheckpointError, UnsafeCheckpointError, ValueError)
}


def corrupt(path: Path | str, problems: Sequence[str], readable: bool = False) -> CorruptCheckpointError:
    """The error for the checkpoint at ``path`` with ``problems`` (each naming its file).

    Args:
        path: The checkpoint: a single file or a distributed checkpoint's folder.
        problems: What is wrong, a file each; the message lists the first three.
        readable: The files differ from what was saved but can be read: the message says how to
            load them unchecked.
    """
    listed = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
    advice = "; CanzonaStrategy(verify_checkpoints=False) loads it unchecked" if readable else ""
    return CorruptCheckpointError(
        f"The checkpoint {path} is corrupt or incomplete: {listed}. Load another checkpoint{advice}."
    )


def describe(error: BaseException) -> str:
    """``error`` in one line: its type and the part of its message that says what failed (torch's
    zip and weights-only errors go on for sentences of advice)."""
    text = str(error)
    if "WeightsUnpickler error:" in text:  # the cause follows torch's advice about weights_only
        text = text.split("WeightsUnpickler error:", 1)[1].strip()
    lines = text.strip().splitlines()
    sentence = _FIRST_SENTENCE.split(lines[0], maxsplit=1)[0] if lines else ""
    return f"{type(error).__name__}: {sentence}" if sentence else type(error).__name__


def on_every_rank(step: Callable[[], T], what: str = "Loading the checkpoint") -> T:
    """``step()`` on this rank, its failure raised on every rank (collective where a process
    group is initialized: one gather of each rank's outcome, also where none failed). ``what``
    names the work in the error of the ranks where it did not fail.

    Returns:
        What ``step`` returned.

    Raises:
        Exception: On the rank whose ``step`` raised, its own exception; on the others the same
            error (a `CorruptCheckpointError`, `UnsafeCheckpointError` or ``ValueError`` of the
            same message; anything else as a ``RuntimeError`` naming the rank).
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return step()
    result, error = None, None
    try:
        result = step()
    except Exception as exception:  # the others must learn of it before this rank raises
        error = exception
    outcomes: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            name, message = outcome
            if name in _SAME_ON_EVERY_RANK:
                raise _SAME_ON_EVERY_RANK[name](message)
            raise RuntimeError(f"{what} failed on rank {rank}: {name}: {message}")
    return result  # type: ignore[return-value]
