"""One agreement on every gradient, over all ranks, before anything is updated.

An optimizer step on many ranks goes wrong in three ways when ranks see different gradients: a
rank raises on a NaN that the others never saw and they wait in the next collective until the
process-group timeout; a rank whose gradient is ``None`` skips a collective (a redistribution of a
``Partial`` gradient) that the others enter; replicas of a parameter step with different
gradients and drift apart. `agree_on_gradients` removes all three with one agreement on the
maximum (`agreement.agree_on_maximum`) of four flags per parameter (some rank holds a gradient,
some rank lacks one, some rank's is non-finite, some rank's is laid out unlike its parameter):

- a non-finite gradient anywhere raises `FloatingPointError` on every rank, naming the parameter;
- a DTensor gradient laid out unlike its parameter is redistributed to the parameter's layout on
  every rank, a rank without one joining with zeros in the same layout;
- when only some ranks hold a gradient, the others get zeros, and along every mesh dimension on
  which the parameter is replicated the gradient of the replica at coordinate 0 is broadcast, so
  that replicas take the same step.

Afterwards every gradient is either ``None`` on every rank or present on every rank in its
parameter's layout, which is what the engine, clipping and the plain-tensor path rely on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_canzona.compat import local_shape
from lightning_canzona.distributed.agreement import agree_on_maximum
from lightning_canzona.rules.base import non_finite

_PRESENT, _ABSENT, _NON_FINITE, _FOREIGN = range(4)


def agree_on_gradients(named: Sequence[tuple[str, Tensor]], check_finite: bool = True) -> list[bool]:
    """Make every rank's view of the gradients of ``named`` parameters consistent (collective).

    Args:
        named: ``(name, parameter)`` pairs, in the same order on every rank.
        check_finite: Raise when some rank's gradient holds NaN or Inf.

    Returns:
        For each parameter, whether it has a gradient (now on every rank).

    Raises:
        FloatingPointError: On every rank, when ``check_finite`` and a gradient is non-finite.
        RuntimeError: On every rank, when ranks hold a gradient in different layouts.
    """
    if not named:
        return []
    flags = torch.zeros(4, len(named), device=named[0][1].device)
    held = [index for index, (_, param) in enumerate(named) if param.grad is not None]
    flags[_PRESENT, held] = 1.0
    flags[_ABSENT] = 1.0 - flags[_PRESENT]
    for index in held:
        param = named[index][1]
        if isinstance(param.grad, DTensor) and tuple(param.grad.placements) != tuple(param.placements):
            flags[_FOREIGN, index] = 1.0
    if check_finite and held:
        local = [_local(named[index][1].grad) for index in held]
        flags[_NON_FINITE, held] = non_finite(local).to(flags)
    if dist.is_initialized() and dist.get_world_size() > 1:
        agree_on_maximum(flags)
    present, absent, bad, foreign = (row.bool().tolist() for row in flags.cpu())
    for (name, param), is_bad in zip(named, bad):
        if is_bad:
            raise FloatingPointError(
                f"The gradient of parameter {name!r} (shape {tuple(param.shape)}) holds NaN or Inf on "
                "some rank; the step was not taken. Lower the learning rate, clip gradients or check "
                "the loss."
            )
    if any(foreign):
        _redistribute([named[i] for i, f in enumerate(foreign) if f])
    for index, (_, param) in enumerate(named):
        if present[index] and absent[index]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if isinstance(param, DTensor):
                _broadcast_along_replicas(param)
    return present


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _redistribute(named: Sequence[tuple[str, Tensor]]) -> None:
    """Bring gradients laid out unlike their parameters into the parameters' layouts, on every rank.

    A rank without a gradient joins the redistribution with zeros in the layout the others hold,
    which it learns from them (``all_gather_object``; this path is rare).
    """
    mine = [tuple(p.grad.placements) if p.grad is not None else None for _, p in named]
    everyone: list[list] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    for index, (name, param) in enumerate(named):
        layouts = {theirs[index] for theirs in everyone} - {None}
        if len(layouts) > 1:
            raise RuntimeError(
                f"Ranks hold the gradient of parameter {name!r} in different layouts "
                f"{sorted(map(str, layouts))}; every rank must compute it with the same parallel plan."
            )
        (placements,) = layouts
        if param.grad is None:
            shape = local_shape(param.shape, param.device_mesh, placements)
            zeros = torch.zeros(shape, dtype=param.dtype, device=_local(param).device)
            param.grad = DTensor.from_local(
                zeros, param.device_mesh, placements, shape=param.shape, stride=param.stride()
            )
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)


def _broadcast_along_replicas(param: DTensor) -> None:
    """Give every replica of ``param`` the gradient of the replica at coordinate 0."""
    local = param.grad.to_local()
    grad = local.contiguous()
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate) and param.device_mesh.size(dim) > 1:
            group = param.device_mesh.get_group(dim)
            dist.broadcast(grad, src=dist.get_global_rank(group, 0), group=group)
    if grad.data_ptr() != local.data_ptr():
        local.copy_(grad)
