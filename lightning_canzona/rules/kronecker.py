"""Kronecker-factor statistics shared by Shampoo and SOAP, whole and over teams.

The left and right factors are moving averages of ``GGᵀ`` and ``GᵀG``; a side longer than
``max_precond_dim`` gets none. How a team splits them: docs/optimizers.md (Teams for Shampoo and SOAP).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_canzona.geometry import long_dim, member_blocks
from lightning_canzona.rules.base import (
    FAILURES,
    State,
    TeamRequest,
    TeamRows,
    TeamSum,
    UpdateCost,
    matrix_dims,
    note_retry,
)

SIDES = ("left", "right")
#: The state that is elementwise in the matrix: what a team member holds its slice of.
MOMENTS = ("exp_avg", "exp_avg_sq")


def preconditioned_sides(rows: int, cols: int, max_precond_dim: int) -> dict[str, int]:
    """The sides that get a factor, with their dimension."""
    return {side: dim for side, dim in zip(SIDES, (rows, cols)) if dim <= max_precond_dim}


def init_state(
    shape: Sequence[int],
    device: torch.device,
    max_precond_dim: int,
    companion: str,
    moments_shape: Sequence[int] | None = None,
    moments_dtype: torch.dtype = torch.float32,
) -> State:
    """Owner-held state, batched like ``shape``: counters, both moments (of ``moments_shape`` if
    given, in ``moments_dtype``), and per preconditioned side its float32 factor and companion
    (``"<side>_<companion>"``), the companion starting as the identity."""
    full = dict(device=device, dtype=torch.float32)
    moments_shape = tuple(shape if moments_shape is None else moments_shape)
    state = {
        "step": 0,
        FAILURES: 0,
        "exp_avg": torch.zeros(moments_shape, device=device, dtype=moments_dtype),
        "exp_avg_sq": torch.zeros(moments_shape, device=device, dtype=moments_dtype),
    }
    batch = tuple(shape[:-2])
    for side, dim in preconditioned_sides(shape[-2], shape[-1], max_precond_dim).items():
        state[side] = torch.zeros(*batch, dim, dim, **full)
        state[f"{side}_{companion}"] = torch.eye(dim, **full).expand(*batch, dim, dim).clone()
    return state


#: The dtypes a decomposition is computed in, in turn, until one succeeds.
PRECISIONS = (torch.float32, torch.float64)


def eigh(factor: Tensor, dtype: torch.dtype, ridge: float = 0.0) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and eigenvectors of symmetric ``factor + ridge·I``, computed in ``dtype``."""
    matrix = factor.to(dtype, copy=bool(ridge))
    if ridge:
        matrix.diagonal(dim1=-2, dim2=-1).add_(ridge)
    return torch.linalg.eigh(matrix)


def decompose(
    state: State, key: str, compute: Callable[[torch.dtype], Tensor], fallback: Tensor | None = None
) -> None:
    """``state[key] ← compute(float32)``, else ``compute(float64)``; kept (or ``fallback``) if both fail.

    A retry is counted (`rules.base.note_retry`), a failure in ``state["decomposition_failures"]``
    with a warning (docs/optimizers.md, Safety).
    """
    for dtype in PRECISIONS:
        if dtype != PRECISIONS[0]:
            note_retry()
        try:
            value = compute(dtype)
            failed = not bool(torch.isfinite(value).all())
        except torch.linalg.LinAlgError:
            failed = True
        if not failed:
            state[key].copy_(value)
            return
    if fallback is not None:
        state[key].copy_(fallback)
    state[FAILURES] = state.get(FAILURES, 0) + 1
    warnings.warn(
        f"The decomposition for {key!r} (shape {tuple(state[key].shape)}) failed; the previous one "
        "is kept (tried in float32, then float64). Counted in telemetry as decomposition failures.",
        RuntimeWarning,
        stacklevel=2,
    )


def update_factors(state: State, grad: Tensor, beta: float) -> None:
    """``L ← β·L + (1 − β)·GGᵀ`` and ``R ← β·R + (1 − β)·GᵀG`` for the sides present."""
    if "left" in state:
        state["left"].lerp_(grad @ grad.mT, 1.0 - beta)
    if "right" in state:
        state["right"].lerp_(grad.mT @ grad, 1.0 - beta)


#: Float32 copies of the matrix a Kronecker-factored update holds at once beside its input and
#: output (the gradient and momentum projected, a product's intermediates), and of its largest
#: factor a decomposition holds: its working set (`UpdateCost.working_bytes`), as the CPU
#: allocator counts it on a step that decomposes (docs/memory.md).
WORKING_COPIES, DECOMPOSITION_COPIES = 4, 3


def cost(shape: Sequence[int], max_precond_dim: int, frequency: int, products: int) -> UpdateCost:
    """Cost of a Kronecker-factored rule on a matrix (or stack) of ``shape``: ``products`` one-sided
    products per preconditioned side, a ``≈ 10d³`` decomposition every ``frequency`` steps."""
    batch, rows, cols = matrix_dims(shape)
    sides = preconditioned_sides(rows, cols, max_precond_dim).values()
    flops = (
        sum(products * 2 * dim * rows * cols + 10 * dim**3 / frequency for dim in sides) + 10 * rows * cols
    )
    decompositions = batch * sum(10 * dim**3 for dim in sides)
    numel = batch * rows * cols
    return UpdateCost(
        flops=float(batch * flops),
        numel=numel,
        matrix_state_bytes=4 * (2 * numel + batch * sum(2 * dim * dim for dim in sides)),
        elementwise_state_bytes=0,
        period=frequency,
        periodic_flops=(float(decompositions),),
        working_bytes=4
        * batch
        * (WORKING_COPIES * rows * cols + DECOMPOSITION_COPIES * max(sides, default=0) ** 2),
    )


def sliced_keys(shape: Sequence[int], max_precond_dim: int, companion: str | None) -> tuple[str, ...]:
    """The state keys a team member holds a slice of: the moments, and the long side's factor (and
    ``companion``, if given) where that side has one."""
    dim = long_dim(shape)
    if shape[dim] > max_precond_dim:
        return MOMENTS
    side = SIDES[dim - (len(shape) - 2)]
    return (*MOMENTS, side) if companion is None else (*MOMENTS, side, f"{side}_{companion}")


def team_cost(
    shape: Sequence[int],
    size: int,
    max_precond_dim: int,
    frequency: int,
    products: int,
    rounds: int,
    gathers: int = 0,
    sliced_companion: bool = True,
) -> UpdateCost | None:
    """Cost to the busiest member when a team of ``size`` computes the matrix, or ``None`` where it
    cannot exactly (a stack, too many members, a long side's factor without ``gathers``)."""
    if len(shape) != 2:
        return None
    long = shape[long_dim(shape)]
    short = shape[0] + shape[1] - long
    if size > long or (long <= max_precond_dim and not gathers):
        return None
    rows = -(-long // size)
    numel = rows * short
    sides = [dim for dim in (short, long) if dim <= max_precond_dim]
    share = (size - 1) / size
    sent = 2 * share * sum(dim * dim / frequency for dim in sides)  # the decompositions, shared
    if short in sides:
        sent += 2 * share * short * short  # the short side's factor, summed
    if long in sides:
        sent += (size - 1) * (gathers * numel + 2 * rows * long / frequency)
    decompositions = [0.0] * size
    for member, dim in ((0, long), (size - 1, short)):
        if dim in sides:
            decompositions[member] += 10 * dim**3
    return UpdateCost(
        flops=float(sum(products * 2 * dim * numel for dim in sides) + 10 * numel),
        numel=numel,
        matrix_state_bytes=4
        * (2 * numel + sum(_factor_numel(dim, dim == long, rows, sliced_companion) for dim in sides)),
        elementwise_state_bytes=0,
        team_messages=rounds,
        team_numel=round(sent) + 2,
        member_flops=tuple(flops / frequency for flops in decompositions),
        period=frequency,
        periodic_flops=tuple(decompositions),
        working_bytes=4 * (WORKING_COPIES * numel + DECOMPOSITION_COPIES * max(sides, default=0) ** 2),
    )


def _factor_numel(dim: int, long: bool, rows: int, sliced_companion: bool) -> int:
    """Elements of a side's factor and companion on a team member."""
    if not long:
        return 2 * dim * dim
    return rows * dim + (rows if sliced_companion else dim) * dim


def init_team_state(
    shape: Sequence[int],
    member: int,
    size: int,
    device: torch.device,
    max_precond_dim: int,
    companion: str,
    sliced: Sequence[str],
    moments_dtype: torch.dtype = torch.float32,
) -> State:
    """A team member's state: its slice of the ``sliced`` keys, the whole of the others."""
    offset, block = member_blocks(shape, size)[member]
    dim = long_dim(shape)
    state = init_state(shape, device, max_precond_dim, companion, block, moments_dtype)
    for key in sliced[len(MOMENTS) :]:
        state[key] = state[key].narrow(dim, offset[dim], block[dim]).clone()
    return state


@contextlib.contextmanager
def moments_in_float32(state: State) -> Iterator[State]:
    """``state`` with its moments, where kept in a lower precision (``state_dtype``), as float32
    copies: each is rounded back into ``state`` once when the block ends without an error, with
    every other key the block set."""
    if state["exp_avg"].dtype == torch.float32:
        yield state
        return
    work = {**state, **{key: state[key].float() for key in MOMENTS}}
    yield work
    for key, value in work.items():
        if key in MOMENTS:
            state[key].copy_(value)
        else:
            state[key] = value


def oriented(
    matrix: Tensor, state: State, shape: Sequence[int], sliced: Sequence[str] = MOMENTS
) -> tuple[Tensor, State]:
    """A team member's slice and state turned so that the sliced side is the rows (sides' keys swapped,
    ``sliced`` tensors as transposed views that write through)."""
    if long_dim(shape) == len(shape) - 2:
        return matrix, state
    swapped = {"left": "right", "right": "left"}
    names = {}
    for key in state:
        side = key.split("_")[0]
        names[swapped[side] + key[len(side) :] if side in swapped else key] = key
    return matrix.mT, _Turned(state, names, frozenset(sliced))


class _Turned(dict):
    """``state`` seen under the view's ``names``, its ``sliced`` tensors transposed (see `oriented`)."""

    def __init__(self, state: State, names: dict[str, str], sliced: frozenset[str]) -> None:
        super().__init__(
            (view, state[key].mT if key in sliced else state[key]) for view, key in names.items()
        )
        self._state, self._names, self._sliced = state, names, sliced

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        name = self._names.setdefault(key, key)
        self._state[name] = value.mT if name in self._sliced else value


def unoriented(direction: Tensor, shape: Sequence[int]) -> Tensor:
    """A direction computed by `oriented` turned back to the slice's own orientation."""
    return direction if long_dim(shape) == len(shape) - 2 else direction.mT


def squared_norm(tensor: Tensor) -> Tensor:
    """``‖X‖²_F`` as a one-element tensor: a member's part of the team's norm."""
    return torch.linalg.vector_norm(tensor).square().reshape(1)


Rounds = Generator[tuple[TeamRequest, ...], tuple[Tensor, ...], dict[str, Tensor]]


def combined(requests: dict[str, TeamRequest]) -> Rounds:
    """One round of named ``requests`` (none: no round); their combinations by name."""
    if not requests:
        return {}
    replies = yield tuple(requests.values())
    return dict(zip(requests, replies))


def factor_requests(grad: Tensor, state: State, sizes: tuple[int, ...]) -> dict[str, TeamRequest]:
    """A member's contributions to the factors: its part of ``GᵀG``, its rows of ``G``."""
    requests: dict[str, TeamRequest] = {}
    if "right" in state:
        requests["right"] = TeamSum(grad.mT @ grad)
    if "left" in state:
        requests["grad"] = TeamRows(grad, sizes)
    return requests


def update_team_factors(state: State, grad: Tensor, replies: dict[str, Tensor], beta: float) -> None:
    """`update_factors` on a member from the replies to `factor_requests`."""
    if "right" in state:
        state["right"].lerp_(replies["right"], 1.0 - beta)
    if "left" in state:
        state["left"].lerp_(grad @ replies["grad"].mT, 1.0 - beta)


def from_member(value: Tensor, source: int, member: int) -> TeamSum:
    """Member ``source``'s ``value`` for every member, as an exact sum with the others' zeros."""
    return TeamSum(value if member == source else torch.zeros_like(value))


def short_side_decomposition(
    state: State, companion: str, member: int, size: int, decompose: Callable[[], None]
) -> dict[str, TeamRequest]:
    """The right factor decomposed by the last member (``decompose()``), and the result to share."""
    if "right" not in state:
        return {}
    if member == size - 1:
        decompose()
    key = f"right_{companion}"
    return {key: from_member(state[key], size - 1, member)}


def shared_decompositions(
    state: State,
    companion: str,
    member: int,
    size: int,
    sizes: tuple[int, ...],
    decompose: Callable[[State, str], None],
) -> Generator[tuple[TeamRequest, ...], tuple[Tensor, ...], None]:
    """Every factor decomposed by one member and shared: the right by the last member, the left
    (gathered whole) by member 0."""
    results = short_side_decomposition(state, companion, member, size, lambda: decompose(state, "right"))
    left = f"left_{companion}"
    if "left" in state:
        rows = {"left": TeamRows(state["left"], sizes), left: TeamRows(state[left], sizes)}
        whole = yield from combined(rows)
        if member == 0:
            whole[FAILURES] = state.get(FAILURES, 0)
            decompose(whole, "left")
            state[FAILURES] = whole[FAILURES]
        results[left] = from_member(whole[left], 0, member)
    shared = yield from combined(results)
    offset = sum(sizes[:member])
    for key, value in shared.items():
        state[key].copy_(value.narrow(-2, offset, sizes[member]) if key == left else value)
