"""A failure on one rank becomes the same error on every rank, at a point every rank reaches.

A rank that raises alone leaves the others waiting in their next collective until the process
group's timeout (30 minutes by default). Work that can fail on one rank only (an update rule, an
allocation) therefore keeps its exception, finishes the step's collectives, and calls
`raise_on_every_rank` with it. Reading at once whether any rank failed would make the host wait
for the device every step, so the flag waits for the next agreement on gradients (`deferred`),
which reads it together with its own flags before the next step or clipping changes anything;
a checkpoint's save and the end of training read it first too (`deferred.settle`). Only then are
the messages exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_canzona.distributed import deferred


def raise_on_every_rank(failure: BaseException | None, device: torch.device, what: str) -> None:
    """Raise the same `RuntimeError` on every rank when ``failure`` happened on any, at the next
    agreement on gradients or `deferred.settle` (collective there; nothing is read here).

    Args:
        failure: This rank's exception, or ``None``.
        device: A device the process group's backend communicates on.
        what: What failed, for the message (e.g. ``"The optimizer step"``).

    Raises:
        RuntimeError: Later, on every rank, naming the failed ranks and their errors; on a failed
            rank its own exception is the cause. In a single process, ``failure`` itself, now.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if failure is not None:
            raise failure
        return

    def then(flags: list[float]) -> None:
        if flags[0]:
            _raise(failure, what)

    deferred.defer(torch.full((1,), float(failure is not None), device=device), then)


def _raise(failure: BaseException | None, what: str) -> None:
    """Raise on every rank, naming every failed rank and its error (collective)."""
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if failure is None else repr(failure))
    described = "; ".join(f"rank {rank}: {message}" for rank, message in enumerate(messages) if message)
    raise RuntimeError(
        f"{what} failed on {described}. Every rank stopped before changing anything else; "
        "parameters may be partly updated, so resume from the last checkpoint."
    ) from failure
