"""Shampoo with Adam-norm grafting (Gupta et al., 2018; Anil et al., 2020).

Kronecker factors ``L``, ``R`` (`kronecker`) precondition the momentum by their inverse fourth roots,
rescaled to the Adam direction's norm. The update, ``epsilon_mode``, its cost and its team form:
docs/optimizers.md#shampoo-with-adam-grafting.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_canzona.geometry import long_dim, split_sizes
from lightning_canzona.rules import kronecker
from lightning_canzona.rules.base import (
    MatrixRule,
    State,
    TeamComputation,
    TeamRows,
    TeamSum,
    UpdateCost,
    check_betas,
    check_non_negative,
    check_positive_int,
    ieee_float32_products,
)

_TINY = torch.finfo(torch.float32).tiny
#: How ``epsilon`` floors a factor's eigenvalues: relative to the largest, or added as it is.
EpsilonMode = Literal["relative", "absolute"]
EPSILON_MODES: tuple[EpsilonMode, ...] = ("relative", "absolute")


def _frobenius(matrix: Tensor) -> Tensor:
    return torch.linalg.vector_norm(matrix, dim=(-2, -1), keepdim=True)


def inverse_fourth_root(
    factor: Tensor, epsilon: float, mode: EpsilonMode = "relative", dtype: torch.dtype = torch.float32
) -> Tensor:
    """``(F + δ·λ_max·I)^(-1/4)`` (``mode="relative"``) or ``(F + δ·I)^(-1/4)`` (``"absolute"``) of a
    symmetric PSD ``factor`` (or stack) by ``eigh``, computed in ``dtype``."""
    eigenvalues, eigenvectors = kronecker.eigh(factor, dtype)
    eigenvalues = eigenvalues.clamp_min(0.0)
    if mode == "relative":
        floor = epsilon * eigenvalues.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    else:  # a zero factor with δ = 0 gives infinite roots, which `kronecker.decompose` refuses
        floor = torch.full_like(eigenvalues[..., :1], epsilon)
    scale = (eigenvalues + floor).pow(-0.25)
    return (eigenvectors * scale.unsqueeze(-2)) @ eigenvectors.mT


@dataclass(frozen=True)
class ShampooRule(MatrixRule):
    """Shampoo's per-matrix math and settings."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    epsilon: float = 1e-6
    precondition_frequency: int = 10
    start_preconditioning_step: int = 10
    max_precond_dim: int = 8192
    epsilon_mode: EpsilonMode = "relative"
    name = "shampoo"

    def __post_init__(self) -> None:
        check_betas("betas", self.betas)
        check_non_negative(eps=self.eps, epsilon=self.epsilon)
        check_positive_int(
            precondition_frequency=self.precondition_frequency,
            start_preconditioning_step=self.start_preconditioning_step,
            max_precond_dim=self.max_precond_dim,
        )
        if self.epsilon_mode not in EPSILON_MODES:
            raise ValueError(f"epsilon_mode must be one of {EPSILON_MODES}, got {self.epsilon_mode!r}")
        object.__setattr__(self, "betas", tuple(self.betas))

    def init_matrix_state(self, shape: torch.Size, device: torch.device) -> State:
        return kronecker.init_state(shape, device, self.max_precond_dim, companion="root")

    def init_team_state(self, shape: Sequence[int], member: int, size: int, device: torch.device) -> State:
        sliced = self.team_sliced_keys(shape)
        return kronecker.init_team_state(shape, member, size, device, self.max_precond_dim, "root", sliced)

    def team_sliced_keys(self, shape: Sequence[int]) -> tuple[str, ...]:
        return kronecker.sliced_keys(shape, self.max_precond_dim, "root")

    @ieee_float32_products
    def direction(self, matrix: Tensor, state: State) -> Tensor:
        grad = matrix.float()
        kronecker.update_factors(state, grad, self.betas[1])
        step, momentum, adam = self._moments(grad, state)
        if step < self.start_preconditioning_step:
            return adam
        if self._decomposes(step):
            for side in kronecker.SIDES:
                if side in state:
                    self._decompose(state, side)
        preconditioned = momentum
        if "left" in state:
            preconditioned = state["left_root"] @ preconditioned
        if "right" in state:
            preconditioned = preconditioned @ state["right_root"]
        return preconditioned * (_frobenius(adam) / _frobenius(preconditioned).clamp_min(_TINY))

    @ieee_float32_products
    def team_direction(
        self, matrix: Tensor, shape: Sequence[int], member: int, size: int, state: State
    ) -> TeamComputation:
        """Rounds: the factors' contributions with the Adam direction's squared norm, the roots'
        sharing on a decomposition step, the preconditioned direction's squared norm."""
        grad, state = kronecker.oriented(matrix.float(), state, shape, self.team_sliced_keys(shape))
        sizes = split_sizes(shape[long_dim(shape)], size)
        step, momentum, adam = self._moments(grad, state)
        preconditioning = step >= self.start_preconditioning_step
        requests = kronecker.factor_requests(grad, state, sizes)
        if preconditioning:
            requests["adam"] = TeamSum(kronecker.squared_norm(adam))
            if "left" in state:
                requests["momentum"] = TeamRows(momentum, sizes)
        replies = yield from kronecker.combined(requests)
        kronecker.update_team_factors(state, grad, replies, self.betas[1])
        if not preconditioning:
            return kronecker.unoriented(adam, shape)
        if self._decomposes(step):
            yield from kronecker.shared_decompositions(state, "root", member, size, sizes, self._decompose)
        preconditioned = momentum
        if "left" in state:
            preconditioned = state["left_root"] @ replies["momentum"]
        if "right" in state:
            preconditioned = preconditioned @ state["right_root"]
        (preconditioned_norm,) = yield (TeamSum(kronecker.squared_norm(preconditioned)),)
        scale = replies["adam"].sqrt() / preconditioned_norm.sqrt().clamp_min(_TINY)
        return kronecker.unoriented(preconditioned * scale, shape)

    def _moments(self, grad: Tensor, state: State) -> tuple[int, Tensor, Tensor]:
        """Count the step and update both moments: the step, ``M̂`` and the Adam direction."""
        beta1, beta2 = self.betas
        state["step"] += 1
        step = state["step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        momentum = exp_avg / (1.0 - beta1**step)
        adam = momentum / (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(self.eps)
        return step, momentum, adam

    def _decomposes(self, step: int) -> bool:
        since_start = step - self.start_preconditioning_step
        return since_start >= 0 and since_start % self.precondition_frequency == 0

    def _decompose(self, state: State, side: str) -> None:
        root = functools.partial(inverse_fourth_root, state[side], self.epsilon, self.epsilon_mode)
        kronecker.decompose(state, f"{side}_root", root)  # root(dtype)

    def cost(self, shape: Sequence[int]) -> UpdateCost:
        return kronecker.cost(shape, self.max_precond_dim, self.precondition_frequency, products=2)

    def team_cost(self, shape: Sequence[int], size: int) -> UpdateCost | None:
        return kronecker.team_cost(
            shape,
            size,
            self.max_precond_dim,
            self.precondition_frequency,
            products=2,
            rounds=2,
            gathers=2,  # the gradient and the momentum, where the long side has a factor
        )
