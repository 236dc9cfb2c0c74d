"""Kronecker-factor statistics shared by Shampoo and SOAP.

For gradients ``G`` of shape ``(…, m, n)`` the left factor ``L`` (``m × m``) and right factor ``R``
(``n × n``) are exponential moving averages of ``GGᵀ`` and ``GᵀG``. A side longer than
``max_precond_dim`` gets no factor: the rule leaves that side unpreconditioned (identity).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_canzona.rules.base import FAILURES, State, UpdateCost, matrix_dims

SIDES = ("left", "right")


def preconditioned_sides(rows: int, cols: int, max_precond_dim: int) -> dict[str, int]:
    """The sides that get a factor, with their dimension."""
    return {side: dim for side, dim in zip(SIDES, (rows, cols)) if dim <= max_precond_dim}


def init_state(shape: torch.Size, device: torch.device, max_precond_dim: int, companion: str) -> State:
    """Owner-held state of a Kronecker-factored rule, all float32 and batched like ``shape``.

    A step counter and a count of failed decompositions (on the host), the two moments, and for
    each preconditioned side its factor (``"left"``, ``"right"``) and the factor's companion
    (``"left_<companion>"``: an inverse root for Shampoo, an eigenbasis for SOAP), starting as the
    identity, which is also what a first decomposition that fails leaves in place.
    """
    full = dict(device=device, dtype=torch.float32)
    state = {
        "step": torch.zeros((), dtype=torch.int64),
        FAILURES: torch.zeros((), dtype=torch.int64),
        "exp_avg": torch.zeros(shape, **full),
        "exp_avg_sq": torch.zeros(shape, **full),
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
