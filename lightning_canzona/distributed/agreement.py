"""How the ranks agree: the step's collectives, one agreement on the gradients, and failures.

An optimizer owns one `GradientAgreement`: the ranks agree once on every gradient before its step
changes anything, and the checks deferred to that agreement (a replica check, the previous step's
failure) are read with it, so that a failure on one rank is the same error on every rank. The
strategies call `average_gradients` and `check_gradients_agree` for the parameters that FSDP2 does
not manage. docs/architecture.md#one-step-on-a-mesh tells the story.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_canzona.compat import data_version, local_shape, use_count
from lightning_canzona.distributed.layout import local_tensor
from lightning_canzona.rules.base import non_finite, norms_not_finite

#: How long `InFlight.wait` waits for the backend to let go of the tensors (microseconds, or a
#: scheduling quantum when the backend's thread is preempted).
PATIENCE_SECONDS = 10.0

#: Largest CPU tensor that gloo combines by one all-to-all rather than a ring all-reduce
#: (docs/benchmarks.md#agreement-collectives has the measurements behind it).
ONE_ROUND_BYTES = 128 * 1024 * 4

#: How far two ranks' gradient checksums may differ, relative to their size, and still count as
#: the same gradient (reductions in another order differ in the last bits).
RELATIVE_TOLERANCE = 1e-4

#: Gives the CPU to another thread (the backend's) without sleeping: a sleep returns too late.
_yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))

_COMBINE = {dist.ReduceOp.SUM: lambda rows: rows.sum(dim=0), dist.ReduceOp.MAX: lambda rows: rows.amax(dim=0)}


class InFlight:
    """An asynchronous collective, ``collective(*args, async_op=True, **kwargs)``; `wait` also waits for
    the backend to let go of its CPU tensors, so that Python frees them (docs/architecture.md, "Shutdown")."""

    def __init__(self, collective: Callable[..., dist.Work], *args: Any, **kwargs: Any) -> None:
        # Only CPU collectives (gloo) free tensors on a thread of their own after completion.
        self._tensors = [arg for arg in args if isinstance(arg, Tensor) and arg.device.type == "cpu"]
        self._references = [use_count(tensor) for tensor in self._tensors]
        self._work: dist.Work | None = collective(*args, async_op=True, **kwargs)

    def wait(self) -> None:
        """Wait for the collective, then for the backend to drop its references to the tensors."""
        assert self._work is not None, "waited twice"
        self._work.wait()
        self._work = None  # the handle holds the tensors too
        deadline = time.monotonic() + PATIENCE_SECONDS
        while any(use_count(t) > n for t, n in zip(self._tensors, self._references)):
            if time.monotonic() > deadline:
                warnings.warn(
                    f"A collective's backend still held its tensors {PATIENCE_SECONDS:g} s after it "
                    "completed; if this process ends before the backend frees them, it may abort.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                break
            _yield_cpu()
        self._tensors = []


def wait_for(collective: Callable[..., dist.Work], *args: Any, **kwargs: Any) -> None:
    """Run ``collective`` to completion, its tensors left to Python (`InFlight`)."""
    InFlight(collective, *args, **kwargs).wait()


class Reduction:
    """The sum or maximum of ``tensor`` over ``group``, in flight; `wait` writes it into ``tensor``. On gloo
    a CPU tensor up to `ONE_ROUND_BYTES` takes one all-to-all, not a ring
    (docs/benchmarks.md#agreement-collectives)."""

    def __init__(self, tensor: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None = None) -> None:
        self.tensor, self._op = tensor, op
        self._world = dist.get_world_size(group)
        self._received: Tensor | None = None
        if _in_one_round(tensor, group, self._world):
            sent = tensor.reshape(-1).repeat(self._world)  # all of it, to every rank
            self._received = torch.empty_like(sent)
            self._work = InFlight(dist.all_to_all_single, self._received, sent, group=group)
        else:
            self._work = InFlight(dist.all_reduce, tensor, op=op, group=group)

    def wait(self) -> Tensor:
        """Wait for the collective; the result, in ``tensor``."""
        self._work.wait()
        if self._received is not None:
            combined = _COMBINE[self._op](self._received.view(self._world, -1))
            self.tensor.copy_(combined.view_as(self.tensor))
            self._received = None
        return self.tensor


def _in_one_round(tensor: Tensor, group: dist.ProcessGroup | None, world: int) -> bool:
    return (
        world > 1
        and tensor.device.type == "cpu"
        and tensor.numel() * tensor.element_size() <= ONE_ROUND_BYTES
        and dist.get_backend(group) == "gloo"
    )


def agree_on_maximum(tensor: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Replace ``tensor`` by its elementwise maximum over ``group`` (collective, blocking)."""
    Reduction(tensor, dist.ReduceOp.MAX, group).wait()


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed on about some parameters' gradients, one flag per parameter.

    Attributes:
        present: It has a gradient (now on every rank).
        non_finite: Some rank's gradient holds NaN or Inf (all ``False`` unless ``checked``).
        overflows: Some rank's gradient is finite but its float32 2-norm is not.
        checked: Whether the values were checked.
    """

    present: list[bool]
    non_finite: list[bool]
    overflows: list[bool]
    checked: bool

    def ordered(self, order: Sequence[int]) -> Agreement:
        """The agreement about the parameters at positions ``order``."""
        pick = lambda flags: [flags[i] for i in order]  # noqa: E731
        return Agreement(pick(self.present), pick(self.non_finite), pick(self.overflows), self.checked)


@dataclass(frozen=True)
class _Verdict:
    """A check's flags on the device, and what to run with their maximum over the ranks."""

    flags: Tensor
    then: Callable[[list[float]], None]


@dataclass(frozen=True)
class _Held:
    """An agreement, and weakly the parameters and gradients (with their versions) it is about."""

    agreement: Agreement
    about: dict[int, tuple[int, weakref.ref, weakref.ref | None, int]]

    @classmethod
    def of(cls, agreement: Agreement, params: Sequence[Tensor]) -> _Held:
        about = {}
        for index, param in enumerate(params):
            grad = param.grad
            version = 0 if grad is None else data_version(local_tensor(grad))
            about[id(param)] = (
                index,
                weakref.ref(param),
                None if grad is None else weakref.ref(grad),
                version,
            )
        return cls(agreement, about)

    def held_for(self, params: Sequence[Tensor], check_finite: bool) -> Agreement | None:
        """The agreement in the order of ``params`` if it still holds for their gradients, else ``None``."""
        if (check_finite and not self.agreement.checked) or len(params) != len(self.about):
            return None
        order = []
        for param in params:
            index, ref, grad, version = self.about.get(id(param), (0, None, None, 0))
            if ref is None or ref() is not param or (grad and grad()) is not param.grad:
                return None
            if param.grad is not None and data_version(local_tensor(param.grad)) != version:
                return None
            order.append(index)
        return self.agreement.ordered(order)

    def params(self) -> list[Tensor] | None:
        """The parameters it is about, in their order (``None`` where one is gone)."""
        params = [ref() for _, ref, _, _ in sorted(self.about.values(), key=lambda about: about[0])]
        return None if any(param is None for param in params) else params  # type: ignore[return-value]


class GradientAgreement:
    """One optimizer's agreement on its gradients, and the checks that wait for it. Every rank makes the
    same calls in the same order. Clipping makes the agreement and the step takes it over while the
    gradients are unchanged (`keep`); a copy of an optimizer starts with a fresh one."""

    def __init__(self) -> None:
        self._held: _Held | None = None
        self._pending: list[_Verdict] = []
        #: Run before each read of the device (its owner's allocations of the coming step, whose
        #: failures it defers to that read: `MatrixOptimizer.reserve_step_buffers`).
        self.before_read: Callable[[], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """A fresh agreement, for copies (what this one holds is about the original's tensors)."""
        return {"_held": None, "_pending": [], "before_read": None}

    def defer(self, flags: Tensor, then: Callable[[list[float]], None]) -> None:
        """Run ``then`` with the ranks' maximum of ``flags`` at the next agreement or `settle`."""
        self._pending.append(_Verdict(flags.reshape(-1).float(), then))

    def settle(self) -> None:
        """Read and run the deferred checks now (collective if any): before a checkpoint, at the end."""
        verdicts, self._pending = self._pending, []
        if verdicts:
            flags = torch.cat([verdict.flags for verdict in verdicts])
            _run(verdicts, _read(flags))

    def raise_on_every_rank(self, failure: BaseException | None, device: torch.device, what: str) -> None:
        """Raise the same `RuntimeError` on every rank if ``failure`` happened on any, at the next
        agreement or `settle` (in a single process, ``failure`` itself, at once). ``what`` names the work
        (``"Muon.step"``); ``device`` is one the backend communicates on."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            if failure is not None:
                raise failure
            return

        def then(flags: list[float]) -> None:
            if flags[0]:
                _raise_everywhere(failure, what)

        self.defer(torch.full((1,), float(failure is not None), device=device), then)

    def agree(self, named: Sequence[tuple[str, Tensor]], check_finite: bool = True) -> Agreement:
        """Agree on the gradients of ``named`` and make them consistent: each is then ``None`` on every
        rank, or present on every rank in its parameter's layout (zeros where a rank had none, replicas
        from coordinate 0). One read, with the deferred checks; none while the held agreement holds.

        Raises:
            RuntimeError: When ranks hold a gradient in different layouts, or a deferred check raises.
        """
        params = [param for _, param in named]
        held = None if self._held is None else self._held.held_for(params, check_finite)
        if held is not None:
            return held
        self._held = None
        if self.before_read is not None:
            self.before_read()
        verdicts, self._pending = self._pending, []
        if not named:
            if verdicts:
                _run(verdicts, _read(torch.cat([verdict.flags for verdict in verdicts])))
            return Agreement([], [], [], check_finite)
        flags = _flags(params, check_finite, local_tensor(params[0]).device)
        values = _read(torch.cat([flags.reshape(-1), *(verdict.flags for verdict in verdicts)]))
        had = [param.grad is not None for param in params]
        _run(verdicts, values[flags.numel() :])
        count = len(params)
        present, absent, suspect, foreign = (
            [bool(value) for value in values[row * count : (row + 1) * count]] for row in range(4)
        )
        # A check may drop a gradient every rank held but none had (`average_gradients`), alike everywhere.
        present = [
            flag and (param.grad is not None or not before)
            for flag, param, before in zip(present, params, had)
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
        self._held = _Held.of(agreement, params)
        return agreement

    def agree_for_step(self, named: Sequence[tuple[str, Tensor]], check_finite: bool = True) -> list[bool]:
        """`agree`, consuming the agreement: per parameter, whether it has a gradient. Raises
        ``FloatingPointError`` on every rank when ``check_finite`` and a gradient is non-finite."""
        agreement = self.agree(named, check_finite)
        self._held = None
        for (name, param), is_bad in zip(named, agreement.non_finite):
            if is_bad and check_finite:
                raise FloatingPointError(
                    f"The gradient of parameter {name!r} (shape {tuple(param.shape)}) holds NaN or Inf on "
                    "some rank; the step was not taken. Lower the learning rate, clip gradients or check "
                    "the loss."
                )
        return agreement.present

    def keep(self) -> None:
        """Let the held agreement stand for its gradients as they are now (clipping scaled them)."""
        params = None if self._held is None else self._held.params()
        if self._held is not None and params is not None:
            self._held = _Held.of(self._held.agreement, params)


def _run(verdicts: Sequence[_Verdict], values: Sequence[float]) -> None:
    start = 0
    for verdict in verdicts:
        end = start + verdict.flags.numel()
        verdict.then(list(values[start:end]))
        start = end


def raise_if_failed_anywhere(
    failure: BaseException | None, device: torch.device, what: str, group: dist.ProcessGroup | None = None
) -> None:
    """Raise the same `RuntimeError` on every rank of ``group`` now if ``failure`` happened on any
    (collective: one read of the device)."""
    flag = torch.full((1,), float(failure is not None), device=device)
    agree_on_maximum(flag, group)
    if flag.item():
        _raise_everywhere(failure, what, group)


def _raise_everywhere(
    failure: BaseException | None, what: str, group: dist.ProcessGroup | None = None
) -> None:
    """Raise on every rank, naming every failed rank and its error (collective)."""
    messages: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if failure is None else repr(failure), group=group)
    ranks = [rank if group is None else dist.get_global_rank(group, rank) for rank in range(len(messages))]
    described = "; ".join(f"rank {rank}: {message}" for rank, message in zip(ranks, messages) if message)
    raise RuntimeError(
        f"{what} failed on {described}. Every rank stopped before changing anything else; "
        "parameters may be partly updated, so resume from the last checkpoint."
    ) from failure


def _flags(params: Sequence[Tensor], check_finite: bool, device: torch.device) -> Tensor:
    """This rank's rows of flags: present, absent, suspect (2-norm not finite), foreign layout."""
    present = _row([param.grad is not None for param in params], device)
    if check_finite:
        empty = torch.empty(0, device=device)
        grads = [local_tensor(param.grad) if param.grad is not None else empty for param in params]
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
    """Which ``suspect`` gradients hold NaN or Inf, by their largest magnitude (a second read)."""
    indices = [index for index, flag in enumerate(suspect) if flag]
    empty = torch.empty(0, device=local_tensor(params[0]).device)
    grads = [local_tensor(params[i].grad) if params[i].grad is not None else empty for i in indices]
    bad = [False] * len(params)
    for index, flag in zip(indices, _read(non_finite(grads).float())):
        bad[index] = bool(flag)
    return bad


def _redistribute(named: Sequence[tuple[str, Tensor]]) -> None:
    """Bring gradients into their parameters' layouts; a rank without one joins with zeros."""
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
            zeros = torch.zeros(shape, dtype=param.dtype, device=local_tensor(param).device)
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


# Gradients of parameters that FSDP2 does not manage, kept equal on every replica.


def average_gradients(
    params: Sequence[Tensor], group: dist.ProcessGroup, agreement: GradientAgreement
) -> None:
    """Average the gradients of ``params`` over ``group`` in one ``all_reduce`` (a rank without one
    adds zeros). A parameter without a gradient on every rank drops it again at ``agreement``'s next
    agreement, which reads the presence flags with its own."""
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
    """``values`` (flat) shaped, typed and laid out as ``param``'s gradient, or as ``param``."""
    like = param.grad if param.grad is not None else param
    local = values.view_as(local_tensor(like)).to(param.dtype)
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def check_gradients_agree(named: Sequence[tuple[str, Tensor]], agreement: GradientAgreement) -> None:
    """Raise on every rank, at ``agreement``'s next agreement, where ranks hold different gradients
    of ``named`` (DTensors are left out: their parts differ by design). Sums may differ by
    `RELATIVE_TOLERANCE` of the largest sum of absolute values."""
    named = [(name, param) for name, param in named if not isinstance(param, DTensor)]
    if not named:
        return
    # Per gradient: presence, sum, sum of absolute values; their maximum and minimum over the ranks.
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
