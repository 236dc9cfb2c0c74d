"""Gradients of trainable parameters that FSDP2 does not manage, kept equal on every replica.

FSDP2 synchronises the gradients of the parameters it manages. A trainable parameter left a plain
tensor (a layer that ``configure_model`` keeps unsharded, or a parameter set directly on the
LightningModule, which FSDP2 cannot manage: Lightning calls ``training_step``, never the root
module's ``forward`` that would run FSDP2's hooks), or a DTensor of the tensor-parallel mesh
alone (a weight tied across two FSDP2 units, `lightning_canzona.composition`), whose gradient
DTensor reduces over that mesh only, would otherwise step with each rank's own
gradient, and its replicas would drift apart without a word. So, after each synchronising
backward: its gradient is averaged over the data-parallel group, as FSDP2 does, and one agreement
on a maximum over all ranks checks that every rank now holds the same gradient, which catches a
plain parameter whose gradient tensor parallelism splits across ranks. Neither reads the device:
what the device knows (which parameters had a gradient, which differ) waits for the next
agreement on gradients, at the latest the optimizer step's, which reads it with its own flags
before anything uses the gradients (`agreement.GradientAgreement.defer`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_canzona.distributed.agreement import GradientAgreement, agree_on_maximum, wait_for
from lightning_canzona.distributed.layout import local_tensor

#: How far two ranks' gradient checksums may differ, relative to their size, and still count as
#: the same gradient (reductions in another order differ in the last bits).
RELATIVE_TOLERANCE = 1e-4


def average_gradients(
    params: Sequence[Tensor], group: dist.ProcessGroup, agreement: GradientAgreement
) -> None:
    """Average the gradients of ``params`` over ``group`` with one ``all_reduce``, a DTensor's by parts.

    A rank without a gradient adds zeros, as under FSDP2. Every rank gets the average, and a
    parameter without a gradient on every rank of ``group`` drops it again (``None``) once the
    device says so: at ``agreement``'s next agreement, which reads it with its own flags, before
    anything reads the gradient.
    """
    if not params:
        return
    device = params[0].device
    pieces = [
        local_tensor(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in params
    ]
    held = [p.grad is not None for p in params]
    presence = torch.ones(len(params), device=device) if all(held) else torch.tensor(held, device=device)
    flat = torch.cat([*pieces, presence.float()])
    wait_for(dist.all_reduce, flat, group=group)
    flat /= dist.get_world_size(group)
    averaged = flat[: -len(params)].split([piece.numel() for piece in pieces])
    for param, value in zip(params, averaged):
        param.grad = _as_gradient_of(param, value)
    agreement.defer(flat[-len(params) :], functools.partial(_drop_absent, list(params)))


def _drop_absent(params: list[Tensor], presence: list[float]) -> None:
    for param, present in zip(params, presence):
        if not present:
            param.grad = None


def _as_gradient_of(param: Tensor, values: Tensor) -> Tensor:
    """``values``, this rank's part flattened, as ``param``'s gradient: shaped, typed and laid out
    as its gradient is (as ``param`` is, where it has none)."""
    like = param.grad if param.grad is not None else param
    local = values.view_as(local_tensor(like)).to(param.dtype)
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def check_gradients_agree(named: Sequence[tuple[str, Tensor]], agreement: GradientAgreement) -> None:
    """Raise on every rank, naming them, when ranks hold different gradients of ``named``, at
    ``agreement``'s next agreement (the check reads nothing itself).

    One agreement on the maximum (`agreement.agree_on_maximum`) over all ranks of each
    gradient's presence, sum and sum of absolute values, and of their negatives. Sums may
    differ by `RELATIVE_TOLERANCE` of the largest sum of absolute values.

    DTensors are left out: their parts differ across the ranks of their mesh by design.
    """
    named = [(name, param) for name, param in named if not isinstance(param, DTensor)]
    if not named:
        return
    rows = []
    for _, param in named:
        if param.grad is None:
            rows.append(torch.zeros(3, dtype=torch.float64, device=param.device))
        else:
            wide = param.grad.double()
            rows.append(torch.stack([torch.ones_like(wide.sum()), wide.sum(), wide.abs().sum()]))
    checksums = torch.stack(rows)
    extremes = torch.cat([checksums, -checksums])
    agree_on_maximum(extremes)
    largest, smallest = extremes[: len(named)], -extremes[len(named) :]
    spread = largest - smallest
    scale = largest[:, 2:3]
    differ = (spread[:, 0] > 0) | (spread[:, 1:] > RELATIVE_TOLERANCE * scale).any(dim=1)
    agreement.defer(differ, functools.partial(_raise_if_differ, [name for name, _ in named]))


def _raise_if_differ(names: list[str], differ: list[float]) -> None:
    differing = [name for name, flag in zip(names, differ) if flag]
    if differing:
        raise RuntimeError(
            f"The gradients of the plain (non-DTensor) parameters {differing} differ across ranks after "
            "averaging over data parallelism, so tensor-parallel ranks would update their replicas "
            "differently. Shard them with the tensor-parallel plan, or make them DTensors whose "
            "gradients are reduced over the tensor-parallel mesh."
        )
