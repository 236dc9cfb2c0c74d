"""Kronecker-factor statistics shared by Shampoo and SOAP.

For gradients ``G`` of shape ``(…, m, n)`` the left factor ``L`` (``m × m``) and right factor ``R``
(``n × n``) are exponential moving averages of ``GGᵀ`` and ``GᵀG``. A side longer than
``max_precond_dim`` gets no factor: the rule leaves that side unpreconditioned (identity).

Teams (`lightning_canzona.planning.teams`) slice a matrix along its long side. Where that side has
no factor, the update splits exactly: the other side's factor is a sum over the slices (``GᵀG =
Σ GᵢᵀGᵢ``), its decomposition is computed by one member and shared, and the moments and the
one-sided products are the slices' own. A matrix with factors on both sides stays whole: a slice's
rows of ``GGᵀ`` and of ``L^(-1/4)·X`` need the whole matrix on every member each step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from lightning_canzona.planning.teams import long_dim, member_blocks
from lightning_canzona.rules.base import FAILURES, State, TeamRequest, TeamSum, UpdateCost, matrix_dims

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
) -> State:
    """Owner-held state of a Kronecker-factored rule, all float32 and batched like ``shape``.

    A step counter and a count of failed decompositions (on the host), the two moments (of
    ``moments_shape``, a team member's slice, if given), and for each preconditioned side its
    factor (``"left"``, ``"right"``) and the factor's companion (``"left_<companion>"``: an
    inverse root for Shampoo, an eigenbasis for SOAP), starting as the identity, which is also
    what a first decomposition that fails leaves in place.
    """
    full = dict(device=device, dtype=torch.float32)
    moments_shape = tuple(shape if moments_shape is None else moments_shape)
    state = {
        "step": torch.zeros((), dtype=torch.int64),
        FAILURES: torch.zeros((), dtype=torch.int64),
        "exp_avg": torch.zeros(moments_shape, **full),
        "exp_avg_sq": torch.zeros(moments_shape, **full),
    }
    batch = tuple(shape[:-2])
    for side, dim in preconditioned_sides(shape[-2], shape[-1], max_precond_dim).items():
        state[side] = torch.zeros(*batch, dim, dim, **full)
        state[f"{side}_{companion}"] = torch.eye(dim, **full).expand(*batch, dim, dim).clone()
    return state


def decompose(state: State, key: str, compute: Callable[[], Tensor], fallback: Tensor | None = None) -> None:
    """``state[key] ← compute()``, a decomposition of a factor, unless it fails.

    An eigensolver or QR can fail to converge, or return NaN, on an ill-conditioned factor. One
    such factor must not end a long run: ``state[key]`` then keeps its value (or takes
    ``fallback``), the failure is counted in ``state["decomposition_failures"]`` (which the
    engine reports in telemetry), and a warning names the factor's shape.
    """
    try:
        value = compute()
        failed = not bool(torch.isfinite(value).all())
    except torch.linalg.LinAlgError:
        failed = True
    if not failed:
        state[key].copy_(value)
        return
    if fallback is not None:
        state[key].copy_(fallback)
    state.setdefault(FAILURES, torch.zeros((), dtype=torch.int64)).add_(1)
    warnings.warn(
        f"The decomposition for {key!r} (shape {tuple(state[key].shape)}) failed; the previous one "
        "is kept. Counted in telemetry as decomposition failures.",
        RuntimeWarning,
        stacklevel=2,
    )


def update_factors(state: State, grad: Tensor, beta: float) -> None:
    """``L ← β·L + (1 − β)·GGᵀ`` and ``R ← β·R + (1 − β)·GᵀG`` for the sides present."""
    if "left" in state:
        state["left"].lerp_(grad @ grad.mT, 1.0 - beta)
    if "right" in state:
        state["right"].lerp_(grad.mT @ grad, 1.0 - beta)


def cost(shape: Sequence[int], max_precond_dim: int, frequency: int, products: int) -> UpdateCost:
    """Cost of a Kronecker-factored rule on a matrix (or stack) of ``shape``.

    Per step and preconditioned side ``d ∈ {m, n}``: ``products`` one-sided ``d × d`` by ``m × n``
    products (``2d·mn`` FLOPs each, the factor update among them) and a ``≈ 10d³`` eigensolve or
    refresh every ``frequency`` steps; plus ``≈ 10·mn`` elementwise. State: both moments, and a
    factor and its companion per side, in float32.
    """
    batch, rows, cols = matrix_dims(shape)
    sides = preconditioned_sides(rows, cols, max_precond_dim).values()
    flops = (
        sum(products * 2 * dim * rows * cols + 10 * dim**3 / frequency for dim in sides) + 10 * rows * cols
    )
    numel = batch * rows * cols
    return UpdateCost(
        flops=float(batch * flops),
        numel=numel,
        matrix_state_bytes=4 * (2 * numel + batch * sum(2 * dim * dim for dim in sides)),
        elementwise_state_bytes=0,
    )


def team_cost(
    shape: Sequence[int], size: int, max_precond_dim: int, frequency: int, products: int, rounds: int
) -> UpdateCost | None:
    """Cost to the busiest member (the one that decomposes the factor) when a team of ``size``
    computes the update of a matrix of ``shape`` together, or ``None`` where it cannot exactly:
    a stack, a long side with a factor, or more members than the long side has slices.

    ``rounds``: the team's collectives per step (besides the factor's sharing, every
    ``frequency`` steps, counted in elements).
    """
    if len(shape) != 2:
        return None
    long = shape[long_dim(shape)]
    short = shape[0] + shape[1] - long
    if long <= max_precond_dim or size > long:
        return None
    rows = -(-long // size)
    sides = [short] if short <= max_precond_dim else []
    numel = rows * short
    return UpdateCost(
        flops=float(sum(products * 2 * dim * numel + 10 * dim**3 / frequency for dim in sides) + 10 * numel),
        numel=numel,
        matrix_state_bytes=4 * (2 * numel + sum(2 * dim * dim for dim in sides)),
        elementwise_state_bytes=0,
        team_messages=rounds,
        # The factor's sum, its decomposition's share amortised, and the grafting norms.
        team_numel=sum(dim * dim + -(-dim * dim // frequency) for dim in sides) + 2,
    )


def init_team_state(
    shape: Sequence[int], member: int, size: int, device: torch.device, max_precond_dim: int, companion: str
) -> State:
    """A team member's state: its slice of the moments, the whole factor and companion."""
    _, block = member_blocks(shape, size)[member]
    return init_state(shape, device, max_precond_dim, companion, moments_shape=block)


def oriented(matrix: Tensor, state: State, shape: Sequence[int]) -> tuple[Tensor, State]:
    """A team member's slice and state, turned so that the sliced side is the rows.

    Where a team slices the columns (`planning.teams.long_dim`), the transposed slice is worked
    on: the left factor of ``Gᵀ`` is the right factor of ``G``, so the sides' keys swap, and the
    moments are transposed views (updates write through to the state).
    """
    if long_dim(shape) == len(shape) - 2:
        return matrix, state
    swapped = {"left": "right", "right": "left"}
    view = {}
    for key, value in state.items():
        side = key.split("_")[0]
        if side in swapped:
            view[swapped[side] + key[len(side) :]] = value
        else:
            view[key] = value.mT if key in MOMENTS else value
    return matrix.mT, view


def unoriented(direction: Tensor, shape: Sequence[int]) -> Tensor:
    """A direction computed by `oriented` turned back to the slice's own orientation."""
    return direction if long_dim(shape) == len(shape) - 2 else direction.mT


def squared_norm(tensor: Tensor) -> Tensor:
    """``‖X‖²_F`` as a one-element tensor: a member's part of the team's norm."""
    return torch.linalg.vector_norm(tensor).square().reshape(1)


def factor_requests(grad: Tensor, state: State) -> tuple[TeamRequest, ...]:
    """A member's part of the right factor's update ``GᵀG = Σ GᵢᵀGᵢ`` (rows sliced), if any."""
    return (TeamSum(grad.mT @ grad),) if "right" in state else ()


def update_summed_factor(state: State, summed: Sequence[Tensor], beta: float) -> None:
    """``R ← β·R + (1 − β)·GᵀG`` from the team's sum (`factor_requests`' reply, first)."""
    if "right" in state:
        state["right"].lerp_(summed[0], 1.0 - beta)


def shared_decomposition(
    state: State, key: str, member: int, decompose_factor: Callable[[], None]
) -> Generator[tuple[TeamRequest, ...], tuple[Tensor, ...], None]:
    """One round: member 0 decomposes (``decompose_factor`` updates ``state[key]``), and every
    member receives its result, as the sum of it and the others' zeros (exact), so that the
    members' factors stay equal bit for bit."""
    if member == 0:
        decompose_factor()
    value = state[key]
    (shared,) = yield (TeamSum(value if member == 0 else torch.zeros_like(value)),)
    value.copy_(shared)
