"""Kronecker-factor statistics shared by Shampoo and SOAP.

For gradients ``G`` of shape ``(…, m, n)`` the left factor ``L`` (``m × m``) and right factor ``R``
(``n × n``) are exponential moving averages of ``GGᵀ`` and ``GᵀG``. A side longer than
``max_precond_dim`` gets no factor: the rule leaves that side unpreconditioned (identity).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_canzona.optim.rules.base import State

SIDES = ("left", "right")


def preconditioned_sides(rows: int, cols: int, max_precond_dim: int) -> dict[str, int]:
    """The sides that get a factor, with their dimension."""
    return {side: dim for side, dim in zip(SIDES, (rows, cols)) if dim <= max_precond_dim}


def init_factors(shape: torch.Size, device: torch.device, max_precond_dim: int) -> State:
    """Zero factors for every preconditioned side, float32, batched like ``shape``."""
    batch = tuple(shape[:-2])
    return {
        side: torch.zeros(*batch, dim, dim, device=device, dtype=torch.float32)
        for side, dim in preconditioned_sides(shape[-2], shape[-1], max_precond_dim).items()
    }


def update_factors(state: State, grad: Tensor, beta: float) -> None:
    """``L ← β·L + (1 − β)·GGᵀ`` and ``R ← β·R + (1 − β)·GᵀG`` for the sides present."""
    if "left" in state:
        state["left"].lerp_(grad @ grad.mT, 1.0 - beta)
    if "right" in state:
        state["right"].lerp_(grad.mT @ grad, 1.0 - beta)


def factor_flops(rows: int, cols: int, sides: dict[str, int]) -> float:
    """FLOPs of one factor update: ``2m²n`` for ``L``, ``2mn²`` for ``R``."""
    return float(sum(2 * dim * rows * cols for dim in sides.values()))
