"""One agreement on every gradient, over all ranks, before anything is updated.

An optimizer step on many ranks goes wrong in three ways when ranks see different gradients: a
rank raises on a NaN that the others never saw and they wait in the next collective until the
process-group timeout; a rank whose gradient is ``None`` skips a collective (a redistribution of a
``Partial`` gradient) that the others enter; replicas of a parameter step with different
gradients and drift apart. `agree` removes all three with one agreement on the maximum
(`agreement.agree_on_maximum`) of four flags per parameter (some rank holds a gradient, some rank
lacks one, some rank's 2-norm is not finite, some rank's gradient is laid out unlike its
parameter):

- a non-finite gradient anywhere is known on every rank, naming the parameter
  (`agree_on_gradients` raises `FloatingPointError`);
- a DTensor gradient laid out unlike its parameter is redistributed to the parameter's layout on
  every rank, a rank without one joining with zeros in the same layout;
- when only some ranks hold a gradient, the others get zeros, and along every mesh dimension on
  which the parameter is replicated the gradient of the replica at coordinate 0 is broadcast, so
  that replicas take the same step.

Afterwards every gradient is either ``None`` on every rank or present on every rank in its
parameter's layout, which is what the engine, clipping and the plain-tensor path rely on.

The agreement is the one read of the device in an optimizer step: it carries the flags of the
checks deferred to it (`deferred`: the replica check, the previous step's failure) and reads
them with its own at once. It is made once per set of gradients: clipping, which needs it first,
makes it, and the step that follows takes it over as long as the gradients are the ones agreed
on (`keep_agreement` after clipping scaled them).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_canzona.compat import data_version, local_shape
from lightning_canzona.distributed import deferred
from lightning_canzona.distributed.agreement import agree_on_maximum
from lightning_canzona.rules.base import non_finite, norms_not_finite

_PRESENT, _ABSENT, _SUSPECT, _FOREIGN = range(4)


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed on about the gradients of some parameters (`agree`).

    Attributes:
        present: Per parameter, whether it has a gradient (now on every rank).
        non_finite: Per parameter, whether some rank's gradient holds NaN or Inf (all ``False``
            where the values were not checked).
        overflows: Per parameter, whether some rank's gradient is finite but its 2-norm (in
            float32) is not: the squares overflow.
        checked: Whether the values were checked.
    """

    present: list[bool]
    non_finite: list[bool]
    overflows: list[bool]
    checked: bool


@dataclass(frozen=True)
class _Latest:
    """The latest agreement and what it is about: by parameter id, the parameter's position, the
    parameter, its gradient and that gradient's `data_version` then (weakly: nothing is kept)."""

    agreement: Agreement
    about: dict[int, tuple[int, weakref.ref, weakref.ref | None, int]]

    def held_for(self, params: Sequence[Tensor], check_finite: bool) -> Agreement | None:
        """The agreement, in the order of ``params``, if it is about them (in any order) and
        their gradients as they are now; else ``None``."""
        if (check_finite and not self.agreement.checked) or len(params) != len(self.about):
            return None
        order = []
        for param in params:
            index, ref, grad, version = self.about.get(id(param), (0, None, None, 0))
            if ref is None or ref() is not param or (grad and grad()) is not param.grad:
                return None
            if param.grad is not None and data_version(_local(param.grad)) != version:
                return None
            order.append(index)
        agreed = self.agreement
        return Agreement(
            [agreed.present[i] for i in order],
            [agreed.non_finite[i] for i in order],
            [agreed.overflows[i] for i in order],
            agreed.checked,
        )

    def params(self) -> list[Tensor] | None:
        """The parameters it is about, in their order (``None`` where one is gone)."""
        params = [ref() for _, ref, _, _ in sorted(self.about.values(), key=lambda about: about[0])]
        return None if any(param is None for param in params) else params  # type: ignore[return-value]


_latest: _Latest | None = None


def _remember(agreement: Agreement, params: Sequence[Tensor]) -> None:
    """Make ``agreement`` the latest, about ``params`` and their gradients as they are now."""
    global _latest
    _latest = _Latest(
        agreement,
        {
            id(param): (
                index,
                weakref.ref(param),
                None if param.grad is None else weakref.ref(param.grad),
                0 if param.grad is None else data_version(_local(param.grad)),
            )
            for index, param in enumerate(params)
        },
    )


def agree(named: Sequence[tuple[str, Tensor]], check_finite: bool = True) -> Agreement:
    """Make every rank's view of the gradients of ``named`` parameters consistent, and say what
    the ranks agreed on (collective: one read of the device, with every deferred verdict, which
    runs first; none where the latest agreement holds for these gradients).

    Args:
        named: ``(name, parameter)`` pairs, in the same order on every rank.
        check_finite: Check the gradients' values (`Agreement.non_finite`).

    Raises:
        RuntimeError: On every rank, when ranks hold a gradient in different layouts; or what a
            deferred verdict raises.
    """
    global _latest
    params = [param for _, param in named]
    held = None if _latest is None else _latest.held_for(params, check_finite)
    if held is not None:
        return held
    _latest = None
    verdicts = deferred.take()
    if not named:
        if verdicts:
            deferred.run(verdicts, _read(torch.cat([verdict.flags for verdict in verdicts])))
        return Agreement([], [], [], check_finite)
    flags = _flags(params, check_finite, _local(params[0]).device)
    values = _read(torch.cat([flags.reshape(-1), *(verdict.flags for verdict in verdicts)]))
    had = [param.grad is not None for param in params]
    deferred.run(verdicts, values[flags.numel() :])
    count = len(params)
    present, absent, suspect, foreign = (
        [bool(value) for value in values[row * count : (row + 1) * count]] for row in range(4)
    )
    # A verdict may drop a gradient that every rank held but none had (`replicas`), alike everywhere.
    present = [
        flag and (param.grad is not None or not before) for flag, param, before in zip(present, params, had)
    ]
    bad = _confirmed(params, suspect) if any(suspect) else suspect
    if any(foreign):
        _redistribute([named[i] for i, f in enumerate(foreign) if f])
    for index, param in enumerate(params):
        if present[index] and absent[index]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if isinstance(param, DTensor):
                _broadcast_along_replicas(param)
    agreement = Agreement(present, bad, [s and not b for s, b in zip(suspect, bad)], check_finite)
    _remember(agreement, params)
    return agreement


def agree_on_gradients(named: Sequence[tuple[str, Tensor]], check_finite: bool = True) -> list[bool]:
    """`agree` on the gradients of ``named`` for a step, which consumes the agreement.

    Returns:
        For each parameter, whether it has a gradient (now on every rank).

    Raises:
        FloatingPointError: On every rank, when ``check_finite`` and a gradient is non-finite.
        RuntimeError: On every rank, when ranks hold a gradient in different layouts.
    """
    global _latest
    agreement = agree(named, check_finite)
    _latest = None
    for (name, param), is_bad in zip(named, agreement.non_finite):
        if is_bad and check_finite:
            raise FloatingPointError(
                f"The gradient of parameter {name!r} (shape {tuple(param.shape)}) holds NaN or Inf on "
                "some rank; the step was not taken. Lower the learning rate, clip gradients or check "
                "the loss."
            )
    return agreement.present


def keep_agreement() -> None:
    """The latest agreement still holds for its gradients as they are now (after an in-place
    change that keeps every agreed fact, as clipping's scaling by a factor in [0, 1])."""
    params = None if _latest is None else _latest.params()
    if _latest is not None and params is not None:
        _remember(_latest.agreement, params)


def _flags(params: Sequence[Tensor], check_finite: bool, device: torch.device) -> Tensor:
    """This rank's four rows of flags, built on the device from host facts by fills (a copy
    of Python data only where the parameters differ, which is rare)."""
    present = _row([param.grad is not None for param in params], device)
    if check_finite:
        empty = torch.empty(0, device=device)
        grads = [_local(param.grad) if param.grad is not None else empty for param in params]
        suspect = norms_not_finite(grads, 2).float()
    else:
        suspect = torch.zeros(len(params), device=device)
    layouts = [
        isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements) for p in params
    ]
    return torch.stack([present, 1.0 - present, suspect, _row(layouts, device)])


def _row(values: list[bool], device: torch.device) -> Tensor:
    if all(values):
        return torch.ones(len(values), device=device)
    if not any(values):
        return torch.zeros(len(values), device=device)
    return torch.tensor(values, dtype=torch.float32, device=device)


def _read(flags: Tensor) -> list[float]:
    """The maximum of ``flags`` over the ranks, read: the agreement's one read of the device."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        agree_on_maximum(flags)
    return flags.tolist()


def _confirmed(params: Sequence[Tensor], suspect: list[bool]) -> list[bool]:
    """Which ``suspect`` gradients (a 2-norm not finite on some rank) hold NaN or Inf: checked by
    their largest magnitude and agreed again (a second read, only when a gradient is non-finite
    or huge)."""
    indices = [index for index, flag in enumerate(suspect) if flag]
    empty = torch.empty(0, device=_local(params[0]).device)
    grads = [_local(params[i].grad) if params[i].grad is not None else empty for i in indices]
    bad = [False] * len(params)
    for index, flag in zip(indices, _read(non_finite(grads).float())):
        bad[index] = bool(flag)
    return bad


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
