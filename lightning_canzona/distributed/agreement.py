"""How the ranks agree: the step's collectives, one agreement on the gradients, and failures.

Every collective of a step goes through `InFlight`, which lets Python, not gloo's thread, free its
tensors. Small sums and maxima take the fewest rounds the backend allows (`Reduction`).

An optimizer owns one `GradientAgreement`. Before its step changes anything, the ranks agree once
on every gradient (`GradientAgreement.agree`): which parameters have one, which are non-finite,
which are laid out unlike their parameter. That agreement is the step's one read of the device.
Checks whose outcome lies on the device, a replica check and the previous step's failure among
them, wait for it (`GradientAgreement.defer`) and are read with it. So a failure on one rank
becomes the same error on every rank, before anything else changes
(`GradientAgreement.raise_on_every_rank`). docs/architecture.md#one-step-on-a-mesh tells the story.

Trainable parameters that FSDP2 does not manage (a layer left unsharded, a parameter set on the
LightningModule, a weight tied across FSDP2 units) would step with each rank's own gradient and
drift apart without a word: after each synchronising backward the strategies average their
gradients over data parallelism (`average_gradients`) and check that every rank holds the same
(`check_gradients_agree`); both defer what the device knows to the next agreement.
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
    """An asynchronous collective, launched, and the tensors given to it.

    gloo keeps a collective's tensors on its own thread until a moment after ``wait()`` returns;
    a tensor Python dropped meanwhile is freed there, and a process that is shutting down then
    aborts. `wait` therefore waits until the backend has let go, so that Python frees them.

    Args:
        collective: A ``torch.distributed`` collective, called with ``async_op=True``.
        *args: Its positional arguments; the tensors among them are the ones kept.
        **kwargs: Its keyword arguments (``group``, split sizes).
    """

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
    """The elementwise sum or maximum of ``tensor`` over ``group``'s ranks, in flight; `wait`
    writes it into ``tensor`` (every rank gets the same values).

    On gloo a CPU tensor up to `ONE_ROUND_BYTES` travels by one all-to-all, combined in rank
    order, instead of the ring all-reduce's ``2·(w − 1)`` rounds.

    Args:
        tensor: This rank's values, replaced by the result.
        op: ``dist.ReduceOp.SUM`` or ``dist.ReduceOp.MAX``.
        group: The ranks (``None``: all).
    """

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
    """Replace ``tensor``, in place, by its elementwise maximum over ``group``'s ranks (collective,
    blocking; every rank gets the same values)."""
    Reduction(tensor, dist.ReduceOp.MAX, group).wait()


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed on about the gradients of some parameters.

    Attributes:
        present: Per parameter, whether it has a gradient (now on every rank).
        non_finite: Per parameter, whether some rank's gradient holds NaN or Inf (all ``False``
            where the values were not checked).
        overflows: Per parameter, whether some rank's gradient is finite but its float32 2-norm
            is not.
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
    """A check's 1-D float32 flags on the device, and what to do with their maximum over the
    ranks (called with Python floats; may raise, on every rank alike)."""

    flags: Tensor
    then: Callable[[list[float]], None]


@dataclass(frozen=True)
class _Held:
    """An agreement and what it is about: by parameter id, the parameter's position, the
    parameter, its gradient and that gradient's `data_version` then (weakly: nothing is kept)."""

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
        """The agreement, in the order of ``params``, if it is about them (in any order) and
        their gradients as they are now; else ``None``."""
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
    """One optimizer's agreement on its gradients, and the checks that wait for it.

    Every rank must make the same calls in the same order (each is collective where it reads).
    An agreement is made once per set of gradients: clipping, which needs it first, makes it,
    and the step that follows takes it over while the gradients are the ones agreed on (`keep`
    after clipping scaled them). A copy of an optimizer starts with a fresh one.
    """

    def __init__(self) -> None:
        self._held: _Held | None = None
        self._pending: list[_Verdict] = []

    def __getstate__(self) -> dict[str, Any]:
        """A fresh agreement, for copies (what this one holds is about the original's tensors)."""
        return {"_held": None, "_pending": []}

    def defer(self, flags: Tensor, then: Callable[[list[float]], None]) -> None:
        """Run ``then`` with the maximum over the ranks of ``flags`` at the next agreement (or
        `settle`), read with it, without a read of its own."""
        self._pending.append(_Verdict(flags.reshape(-1).float(), then))

    def settle(self) -> None:
        """Agree on every deferred check now and run them (collective where any is pending: one
        read of the device): before a checkpoint is written, at the end of training."""
        verdicts, self._pending = self._pending, []
        if verdicts:
            flags = torch.cat([verdict.flags for verdict in verdicts])
            _run(verdicts, _read(flags))

    def raise_on_every_rank(self, failure: BaseException | None, device: torch.device, what: str) -> None:
        """Raise the same `RuntimeError` on every rank when ``failure`` happened on any, at the
        next agreement or `settle` (nothing is read here); in a single process, at once.

        Args:
            failure: This rank's exception, or ``None``.
            device: A device the process group's backend communicates on.
            what: What failed, for the message (e.g. ``"Muon.step"``).
        """
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            if failure is not None:
                raise failure
            return

        def then(flags: list[float]) -> None:
            if flags[0]:
                _raise_everywhere(failure, what)

        self.defer(torch.full((1,), float(failure is not None), device=device), then)

    def agree(self, named: Sequence[tuple[str, Tensor]], check_finite: bool = True) -> Agreement:
        """Make every rank's view of the gradients of ``named`` consistent, and say what the
        ranks agreed on (collective: one read, with every deferred check, which runs first;
        none where the held agreement is about these gradients as they are).

        Afterwards every gradient is ``None`` on every rank, or present on every rank in its
        parameter's layout: a rank without one gets zeros, a gradient laid out unlike its
        parameter is redistributed, and replicas take the gradient of the replica at coordinate 0.

        Raises:
            RuntimeError: On every rank, when ranks hold a gradient in different layouts; or what
                a deferred check raises.
        """
        params = [param for _, param in named]
        held = None if self._held is None else self._held.held_for(params, check_finite)
        if held is not None:
            return held
        self._held = None
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
        """`agree` for a step, which consumes the agreement: per parameter, whether it has a
        gradient (now on every rank).

        Raises:
            FloatingPointError: On every rank, when ``check_finite`` and a gradient is non-finite.
            RuntimeError: As `agree`.
        """
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
        """The held agreement still holds for its gradients as they are now (after an in-place
        change that keeps every agreed fact, as clipping's scaling by a factor in [0, 1])."""
        params = None if self._held is None else self._held.params()
        if self._held is not None and params is not None:
            self._held = _Held.of(self._held.agreement, params)


def _run(verdicts: Sequence[_Verdict], values: Sequence[float]) -> None:
    """Run each of ``verdicts`` with its part of ``values`` (their flags' agreed values, in order)."""
    start = 0
    for verdict in verdicts:
        end = start + verdict.flags.numel()
        verdict.then(list(values[start:end]))
        start = end


def _raise_everywhere(failure: BaseException | None, what: str) -> None:
    """Raise on every rank, naming every failed rank and its error (collective)."""
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if failure is None else repr(failure))
    described = "; ".join(f"rank {rank}: {message}" for rank, message in enumerate(messages) if message)
    raise RuntimeError(
        f"{what} failed on {described}. Every rank stopped before changing anything else; "
        "parameters may be partly updated, so resume from the last checkpoint."
    ) from failure


def _flags(params: Sequence[Tensor], check_finite: bool, device: torch.device) -> Tensor:
    """This rank's four rows of flags (present, absent, suspect, foreign layout), built on the
    device from host facts by fills."""
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
    """Which ``suspect`` gradients (a 2-norm not finite on some rank) hold NaN or Inf: checked by
    their largest magnitude and agreed again (a second read, only for a non-finite or huge one)."""
    indices = [index for index, flag in enumerate(suspect) if flag]
    empty = torch.empty(0, device=local_tensor(params[0]).device)
    grads = [local_tensor(params[i].grad) if params[i].grad is not None else empty for i in indices]
    bad = [False] * len(params)
    for index, flag in zip(indices, _read(non_finite(grads).float())):
        bad[index] = bool(flag)
    return bad


def _redistribute(named: Sequence[tuple[str, Tensor]]) -> None:
    """Bring gradients laid out unlike their parameters into the parameters' layouts, on every
    rank; a rank without one joins with zeros in the layout the others hold (rare: one
    ``all_gather_object``)."""
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
