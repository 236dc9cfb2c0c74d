"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al., 2024).

For gradient ``G`` (``m × n``) at step ``t``, betas ``(β₁, β₂)``, factor decay ``β_s``
(``shampoo_beta``, default ``β₂``) and learning rate ``γ``::

    L ← β_s·L + (1 − β_s)·GGᵀ        R ← β_s·R + (1 − β_s)·GᵀG
    t = 1:        Q_L, Q_R ← eigenvectors of L, R (eigh, largest eigenvalue first)
    t ≡ 0 mod f:  Q ← QR(F·Q) for F = L, R: one power iteration, after ordering Q's columns (and
                  V's matching axis) by the estimated eigenvalues diag(QᵀFQ), largest first
    G' = Q_Lᵀ·G·Q_R                  M ← β₁·M + (1 − β₁)·G          M' = Q_Lᵀ·M·Q_R
    V ← β₂·V + (1 − β₂)·G'⊙G'
    D = Q_L · (c·M' / (√V + ε)) · Q_Rᵀ   with  c = √(1 − β₂ᵗ) / (1 − β₁ᵗ)   (bias correction)
    W ← W·(1 − γλ) − γ·D

``M`` stays in the original coordinates, as in the paper's algorithm, so a basis refresh never
mixes momenta from two bases; ``V`` lives in the rotated coordinates. A side longer than
``max_precond_dim`` keeps the identity basis.

Cost per step, summing over the preconditioned sides ``d ∈ {m, n}``: the factor update and the three
one-sided rotations (of ``G``, ``M`` and back) cost ``Σ 8d·mn``; each refresh costs ``≈ 10d³`` per side
(two ``d × d`` products for the eigenvalue estimate, one for the power iteration, a Householder
QR), amortised over ``f`` = precondition_frequency. All of its state is matrix state on the owner.
A matrix whose long side has no factor can be computed by a team (`kronecker`): one collective per
step, the factor's sum.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_canzona.planning.teams import long_dim, split_sizes
from lightning_canzona.rules import kronecker
from lightning_canzona.rules.base import MatrixRule, State, TeamComputation, UpdateCost


def _project(matrix: Tensor, state: State, *, back: bool = False) -> Tensor:
    """``Q_Lᵀ·X·Q_R`` (or ``Q_L·X·Q_Rᵀ`` with ``back``), skipping sides without a basis."""
    if "left_basis" in state:
        left = state["left_basis"]
        matrix = (left if back else left.mT) @ matrix
    if "right_basis" in state:
        right = state["right_basis"]
        matrix = matrix @ (right.mT if back else right)
    return matrix


def _eigenbasis(factor: Tensor) -> Tensor:
    """Eigenvectors of a symmetric factor, columns ordered by decreasing eigenvalue."""
    _, eigenvectors = torch.linalg.eigh(factor)
    return eigenvectors.flip(-1)


def _power_iteration(factor: Tensor, basis: Tensor) -> Tensor:
    return torch.linalg.qr(factor @ basis).Q


def _reordered_basis(state: State, side: str) -> Tensor:
    """``side``'s basis with its columns ordered by the estimated eigenvalues ``diag(QᵀFQ)``,
    largest first; ``exp_avg_sq``'s matching axis is reordered with them (in ``state``)."""
    axis = -2 if side == "left" else -1
    factor, basis = state[side], state[f"{side}_basis"]
    estimated = torch.diagonal(basis.mT @ factor @ basis, dim1=-2, dim2=-1)
    order = estimated.argsort(dim=-1, descending=True)
    order_shape = order.unsqueeze(-1) if axis == -2 else order.unsqueeze(-2)
    state["exp_avg_sq"].copy_(state["exp_avg_sq"].take_along_dim(order_shape, dim=axis))
    return basis.take_along_dim(order.unsqueeze(-2), dim=-1)


def _first_basis(state: State, side: str) -> None:
    kronecker.decompose(state, f"{side}_basis", functools.partial(_eigenbasis, state[side]))


def _refreshed_basis(state: State, side: str, basis: Tensor) -> None:
    """One QR power iteration from the reordered ``basis`` (kept if it fails)."""
    power_iteration = functools.partial(_power_iteration, state[side], basis)
    kronecker.decompose(state, f"{side}_basis", power_iteration, fallback=basis)


@dataclass(frozen=True)
class SOAPRule(MatrixRule):
    """SOAP's per-matrix math (see the module docstring for the formulas)."""

    betas: tuple[float, float] = (0.95, 0.95)
    shampoo_beta: float | None = None
    eps: float = 1e-8
    precondition_frequency: int = 10
    max_precond_dim: int = 10_000
    name = "soap"

    def init_matrix_state(self, shape: torch.Size, device: torch.device) -> State:
        return kronecker.init_state(shape, device, self.max_precond_dim, companion="basis")

    def init_team_state(self, shape: Sequence[int], member: int, size: int, device: torch.device) -> State:
        return kronecker.init_team_state(shape, member, size, device, self.max_precond_dim, companion="basis")

    def team_sliced_keys(self, shape: Sequence[int]) -> tuple[str, ...]:
        return kronecker.MOMENTS  # a long side with a factor is never split (see `team_cost`)

    def direction(self, matrix: Tensor, state: State) -> Tensor:
        state["step"] += 1
        step = int(state["step"])
        grad = matrix.float()
        kronecker.update_factors(state, grad, self._factor_beta)
        for side in kronecker.SIDES:
            if side in state and step == 1:
                _first_basis(state, side)
            elif side in state and step % self.precondition_frequency == 0:
                _refreshed_basis(state, side, _reordered_basis(state, side))
        return self._adam_in_eigenbasis(grad, state, step)

    def team_direction(
        self, matrix: Tensor, shape: Sequence[int], member: int, size: int, state: State
    ) -> TeamComputation:
        """Rounds: the right factor's sum, and its basis's sharing on a basis step."""
        grad, state = kronecker.oriented(matrix.float(), state, shape)
        sizes = split_sizes(shape[long_dim(shape)], size)
        state["step"] += 1
        step = int(state["step"])
        replies = yield from kronecker.combined(kronecker.factor_requests(grad, state, sizes))
        kronecker.update_team_factors(state, grad, replies, self._factor_beta)
        decompose = None
        if "right" in state and step == 1:
            decompose = _first_basis
        elif "right" in state and step % self.precondition_frequency == 0:
            # Every member reorders its slice of exp_avg_sq; the order is the same on all.
            reordered = _reordered_basis(state, "right")
            decompose = functools.partial(_refreshed_basis, basis=reordered)
        if decompose is not None:
            yield from kronecker.shared_decompositions(state, "basis", member, size, sizes, decompose)
        return kronecker.unoriented(self._adam_in_eigenbasis(grad, state, step), shape)

    @property
    def _factor_beta(self) -> float:
        return self.betas[1] if self.shampoo_beta is None else self.shampoo_beta

    def _adam_in_eigenbasis(self, grad: Tensor, state: State, step: int) -> Tensor:
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        rotated_grad = _project(grad, state)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(rotated_grad, rotated_grad, value=1.0 - beta2)
        correction = (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)
        rotated_step = _project(exp_avg, state) / exp_avg_sq.sqrt().add_(self.eps)
        return _project(rotated_step.mul_(correction), state, back=True)

    def cost(self, shape: Sequence[int]) -> UpdateCost:
        return kronecker.cost(shape, self.max_precond_dim, self.precondition_frequency, products=4)

    def team_cost(self, shape: Sequence[int], size: int) -> UpdateCost | None:
        sides = len(kronecker.preconditioned_sides(*shape[-2:], self.max_precond_dim))
        return kronecker.team_cost(
            shape, size, self.max_precond_dim, self.precondition_frequency, products=4, rounds=sides
        )
