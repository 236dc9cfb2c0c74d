"""A failure on one rank becomes the same error on every rank, at a point every rank reaches.

A rank that raises alone leaves the others waiting in their next collective until the process
group's timeout (30 minutes by default). Work that can fail on one rank only (an update rule, an
allocation) therefore keeps its exception, finishes the step's collectives, and calls
`raise_on_every_rank` with it: one agreement on a one-element maximum
(`agreement.agree_on_maximum`) tells every rank whether anyone failed, and only then are the
messages exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_canzona.distributed.agreement import agree_on_maximum


def raise_on_every_rank(failure: BaseException | None, device: torch.device, what: str) -> None:
    """Raise the same `RuntimeError` on every rank when ``failure`` happened on any (collective).

    Args:
        failure: This rank's exception, or ``None``.
        device: A device the process group's backend communicates on.
        what: What failed, for the message (e.g. ``"The optimizer step"``).

    Raises:
        RuntimeError: On every rank, naming the failed ranks and their errors; on a failed rank
            its own exception is the cause. In a single process, ``failure`` itself.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if failure is not None:
            raise failure
        return
    failed = torch.tensor(float(failure is not None), device=device)
    agree_on_maximum(failed)
    if not failed.item():
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if failure is None else repr(failure))
    described = "; ".join(f"rank {rank}: {message}" for rank, message in enumerate(messages) if message)
    raise RuntimeError(
        f"{what} failed on {described}. Every rank stopped here; parameters may be partly updated, "
        "so resume from the last checkpoint."
    ) from failure
