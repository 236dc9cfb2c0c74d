"""Verdicts that wait on the device for the next agreement on gradients, read with it at once.

A check whose outcome lies in tensors on the device — that every replica of a plain parameter
holds the same gradient (`replicas`), that no rank failed in the previous optimizer step
(`failures`) — would make the host wait for the device if it read them at once, and a GPU
drains its queue at every such read. Instead the check hands its flags to `defer`, with what to
do once they are known. The next agreement on gradients
(`lightning_canzona.distributed.gradients.agree`, made by clipping or by the optimizer step,
before either changes anything) takes the maximum of them over the ranks together with its own
flags, reads them all in its one read, and runs each verdict, in the order they were deferred.
`settle` does the same at once where no agreement comes soon enough: before a checkpoint is
written, at the end of training.

Every rank defers the same checks in the same order (each check is collective anyway), so that
the flags line up in the agreement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_canzona.distributed.agreement import agree_on_maximum


@dataclass(frozen=True)
class Verdict:
    """A check's flags and what to do with their maximum over the ranks.

    Attributes:
        flags: 1-D float32 flags on the device.
        then: Called with the agreed flags, as Python floats; may raise (on every rank alike).
    """

    flags: Tensor
    then: Callable[[list[float]], None]


_pending: list[Verdict] = []


def defer(flags: Tensor, then: Callable[[list[float]], None]) -> None:
    """Run ``then`` with the maximum over the ranks of ``flags`` at the next agreement (or
    `settle`), read with it without a read of its own."""
    _pending.append(Verdict(flags.reshape(-1).float(), then))


def take() -> list[Verdict]:
    """The verdicts deferred so far, which the caller now owes a read and a run."""
    verdicts = list(_pending)
    _pending.clear()
    return verdicts


def run(verdicts: Sequence[Verdict], values: Sequence[float]) -> None:
    """Run each of ``verdicts`` with its part of ``values`` (their flags' agreed values, in order)."""
    start = 0
    for verdict in verdicts:
        end = start + verdict.flags.numel()
        verdict.then(list(values[start:end]))
        start = end


def settle() -> None:
    """Agree on every deferred verdict now and run them (collective where any is pending: one
    read of the device)."""
    verdicts = take()
    if not verdicts:
        return
    flags = torch.cat([verdict.flags for verdict in verdicts])
    if dist.is_initialized() and dist.get_world_size() > 1:
        agree_on_maximum(flags)
    run(verdicts, flags.tolist())
