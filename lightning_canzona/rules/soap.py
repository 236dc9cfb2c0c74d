"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al., 2024).

The first step only starts the factors and their eigenbases; each later step rotates the gradient
and momentum with the bases of the gradients before it (the authors' order), takes Adam's step
there and rotates it back, then refreshes the bases every ``precondition_frequency`` steps. The
update, the weight-decay orders, its cost and its team form: docs/optimizers.md#soap.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_canzona.geometry import long_dim, split_sizes
from lightning_canzona.rules import kronecker
from lightning_canzona.rules.base import (
    FAILURES,
    STATE_DTYPES,
    MatrixRule,
    Rule,
    State,
    TeamComputation,
    TeamRequest,
    TeamRows,
    UpdateCost,
    check_betas,
    check_non_negative,
    check_positive_int,
    check_state_dtype,
    check_unit_interval,
    ieee_float32_products,
    scale_,
    setting,
)

#: Where SOAP's weight decay goes: before the update (default) or after it, as the authors' code.
WEIGHT_DECAY_ORDERS = ("decay_first", "update_first")


def _project(matrix: Tensor, state: State, *, back: bool = False, rows: slice | None = None) -> Tensor:
    """``Q_Lᵀ·X·Q_R`` (or ``Q_L·X·Q_Rᵀ`` with ``back``), skipping sides without a basis; only the
    team member's ``rows`` of the result if given. The long side turns first, as a team's members do."""
    left, right = state.get("left_basis"), state.get("right_basis")
    if rows is not None and left is not None:
        left = left[rows] if back else left[:, rows]

    def turn_left(x: Tensor) -> Tensor:
        return x if left is None else (left if back else left.mT) @ x

    def turn_right(x: Tensor) -> Tensor:
        return x if right is None else x @ (right.mT if back else right)

    columns_long = long_dim(matrix.shape) == matrix.dim() - 1
    if not back and rows is None and columns_long:
        return turn_left(turn_right(matrix))
    return turn_right(turn_left(matrix))


#: Added to a factor's diagonal before its eigendecomposition, as the authors' code does: it only
#: moves a factor with an all-zero row (a gradient's zero row) off exact singularity.
RIDGE = 1e-30


def _eigenbasis(factor: Tensor, dtype: torch.dtype) -> Tensor:
    """Eigenvectors of a symmetric factor, largest eigenvalue first, computed in ``dtype``."""
    _, eigenvectors = kronecker.eigh(factor, dtype, RIDGE)
    return eigenvectors.flip(-1)


def _power_iteration(factor: Tensor, basis: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.linalg.qr(factor.to(dtype) @ basis.to(dtype)).Q


def _reordered_basis(state: State, side: str) -> tuple[Tensor, Tensor]:
    """``side``'s basis ordered by ``diag(QᵀFQ)``, largest first, and that order (``exp_avg_sq`` with it)."""
    factor, basis = state[side], state[f"{side}_basis"]
    estimated = torch.diagonal(basis.mT @ factor @ basis, dim1=-2, dim2=-1)
    order = estimated.argsort(dim=-1, descending=True)
    axis = -2 if side == "left" else -1
    order_shape = order.unsqueeze(-1) if axis == -2 else order.unsqueeze(-2)
    state["exp_avg_sq"].copy_(state["exp_avg_sq"].take_along_dim(order_shape, dim=axis))
    return basis.take_along_dim(order.unsqueeze(-2), dim=-1), order


def _first_basis(state: State, side: str) -> None:
    kronecker.decompose(state, f"{side}_basis", functools.partial(_eigenbasis, state[side]))


def _refreshed_basis(state: State, side: str, basis: Tensor) -> None:
    """One QR power iteration from the reordered ``basis`` (kept if it fails)."""
    power_iteration = functools.partial(_power_iteration, state[side], basis)
    kronecker.decompose(state, f"{side}_basis", power_iteration, fallback=basis)


@dataclass(frozen=True)
class SOAPRule(MatrixRule):
    """SOAP's per-matrix math and settings."""

    betas: tuple[float, float] = (0.95, 0.95)
    shampoo_beta: float | None = None
    eps: float = 1e-8
    precondition_frequency: int = 10
    max_precond_dim: int = 10_000
    #: ``"decay_first"`` or ``"update_first"`` (the authors' order: docs/optimizers.md#soap).
    weight_decay_order: str = "decay_first"
    #: This step is the param group's first, whose update is zero: ``update_first`` skips its decay.
    #: Not part of the rule's identity: a plan is built for the rules, and this changes each step.
    #: Counted by `lightning_canzona.SOAP` in the group's ``soap_steps``, not set by the user.
    first_step: bool = setting(False, read=False, compare=False)
    #: The moments' dtype (``None``: float32), the optimizer's ``state_dtype``, which every group holds.
    state_dtype: str | None = setting(None, read=False)
    name = "soap"

    def __post_init__(self) -> None:
        check_betas("betas", self.betas)
        check_non_negative(eps=self.eps)
        if self.shampoo_beta is not None:
            check_unit_interval(shampoo_beta=self.shampoo_beta)
        check_positive_int(
            precondition_frequency=self.precondition_frequency, max_precond_dim=self.max_precond_dim
        )
        if self.weight_decay_order not in WEIGHT_DECAY_ORDERS:
            raise ValueError(
                f"weight_decay_order must be one of {WEIGHT_DECAY_ORDERS}, got {self.weight_decay_order!r}"
            )
        check_state_dtype(self.state_dtype)
        object.__setattr__(self, "betas", tuple(self.betas))

    @classmethod
    def from_group(cls: type[Rule], group: Mapping[str, Any], **values: Any) -> Rule:
        first_step, state_dtype = group.get("soap_steps", 0) == 0, group.get("state_dtype")
        return super().from_group(group, **{"first_step": first_step, "state_dtype": state_dtype, **values})

    @property
    def _moments_dtype(self) -> torch.dtype:
        return torch.float32 if self.state_dtype is None else STATE_DTYPES[self.state_dtype]

    def init_matrix_state(self, shape: torch.Size, device: torch.device) -> State:
        return kronecker.init_state(shape, device, self.max_precond_dim, "basis", None, self._moments_dtype)

    def apply(
        self,
        params: Sequence[Tensor],
        directions: Sequence[Tensor],
        *,
        lr: float,
        weight_decay: float,
        shapes: Sequence[Sequence[int]],
    ) -> None:
        """`MatrixRule.apply`, or for ``update_first`` the step, then the decay, neither on the first step."""
        if self.weight_decay_order == "decay_first":
            super().apply(params, directions, lr=lr, weight_decay=weight_decay, shapes=shapes)
        elif not self.first_step:
            super().apply(params, directions, lr=lr, weight_decay=0.0, shapes=shapes)
            if weight_decay:
                scale_(params, 1.0 - lr * weight_decay)

    def init_team_state(self, shape: Sequence[int], member: int, size: int, device: torch.device) -> State:
        sliced = self.team_sliced_keys(shape)
        return kronecker.init_team_state(
            shape, member, size, device, self.max_precond_dim, "basis", sliced, self._moments_dtype
        )

    def team_sliced_keys(self, shape: Sequence[int]) -> tuple[str, ...]:
        return kronecker.sliced_keys(shape, self.max_precond_dim, companion=None)

    @ieee_float32_products
    def direction(self, matrix: Tensor, state: State) -> Tensor:
        with kronecker.moments_in_float32(state) as work:
            return self._direction(matrix, work)

    def _direction(self, matrix: Tensor, state: State) -> Tensor:
        state["step"] += 1
        step = state["step"]
        grad = matrix.float()
        direction = torch.zeros_like(grad)
        if step > 1:
            state["exp_avg"].lerp_(grad, 1.0 - self.betas[0])
            direction = self._whole_step(grad, state, step)
        kronecker.update_factors(state, grad, self._factor_beta)
        for side in kronecker.SIDES:
            if side in state and step == 1:
                _first_basis(state, side)
            elif side in state and self._refreshes(step):
                _refreshed_basis(state, side, _reordered_basis(state, side)[0])
        return direction

    @ieee_float32_products
    def team_direction(
        self, matrix: Tensor, shape: Sequence[int], member: int, size: int, state: State
    ) -> TeamComputation:
        """Rounds: the factors' contributions, the rotated step gathered for the way back where the long
        side has a factor, and the bases' sharing on a basis step."""
        with kronecker.moments_in_float32(state) as work:
            return (yield from self._team_direction(matrix, shape, member, size, work))

    def _team_direction(
        self, matrix: Tensor, shape: Sequence[int], member: int, size: int, state: State
    ) -> TeamComputation:
        grad, state = kronecker.oriented(matrix.float(), state, shape, self.team_sliced_keys(shape))
        sizes = split_sizes(shape[long_dim(shape)], size)
        rows = slice(sum(sizes[:member]), sum(sizes[: member + 1]))
        state["step"] += 1
        step = state["step"]
        if step > 1:
            state["exp_avg"].lerp_(grad, 1.0 - self.betas[0])
        requests = kronecker.factor_requests(grad, state, sizes)
        if "left" in state and step > 1:
            requests["momentum"] = TeamRows(state["exp_avg"], sizes)
        replies = yield from kronecker.combined(requests)
        direction = torch.zeros_like(grad)
        if step > 1 and "left" not in state:
            direction = self._whole_step(grad, state, step)
        elif step > 1:
            rotated = self._rotated_step(replies["grad"], replies["momentum"], state, step - 1, rows)
            (gathered,) = yield (TeamRows(rotated, sizes),)
            direction = _project(gathered, state, back=True, rows=rows)
        kronecker.update_team_factors(state, grad, replies, self._factor_beta)
        if step == 1 or self._refreshes(step):
            yield from self._shared_bases(state, step == 1, member, size, sizes, rows)
        return kronecker.unoriented(direction, shape)

    def _whole_step(self, grad: Tensor, state: State, step: int) -> Tensor:
        """Adam's step ``step − 1`` from this rank's gradient and momentum alone."""
        return _project(self._rotated_step(grad, state["exp_avg"], state, step - 1), state, back=True)

    def _refreshes(self, step: int) -> bool:
        """Whether the bases are refreshed after the optimizer's ``step``."""
        return step > 1 and (step - 1) % self.precondition_frequency == 0

    def _shared_bases(
        self, state: State, first: bool, member: int, size: int, sizes: tuple[int, ...], rows: slice
    ) -> Generator[tuple[TeamRequest, ...], tuple[Tensor, ...], None]:
        """The bases' first decompositions or refreshes, each by one member (the long side's by member 0,
        on the factor and second moment gathered whole), and shared with every member."""
        decompose = functools.partial(_first_basis, state, "right")
        if "right" in state and not first:  # every member reorders its own slice, all alike
            decompose = functools.partial(
                _refreshed_basis, state, "right", _reordered_basis(state, "right")[0]
            )
        shared = kronecker.short_side_decomposition(state, "basis", member, size, decompose)
        if "left" in state:
            gathers = {"left": TeamRows(state["left"], sizes)}
            if not first:
                gathers["exp_avg_sq"] = TeamRows(state["exp_avg_sq"], sizes)
            whole = yield from kronecker.combined(gathers)
            basis = state["left_basis"].clone()
            order = torch.zeros(basis.shape[-1], dtype=torch.float32, device=basis.device)
            if member == 0:  # as one rank: on a whole factor, basis and second moment (a copy)
                work = {"left": whole["left"], "left_basis": basis, FAILURES: state.get(FAILURES, 0)}
                if first:
                    _first_basis(work, "left")
                else:
                    work["exp_avg_sq"] = whole["exp_avg_sq"].clone()
                    reordered, indices = _reordered_basis(work, "left")
                    _refreshed_basis(work, "left", reordered)
                    order = indices.to(order.dtype)
                state[FAILURES] = work[FAILURES]
            shared["left_basis"] = kronecker.from_member(basis, 0, member)
            if not first:
                shared["order"] = kronecker.from_member(order, 0, member)  # integers: exact
        replies = yield from kronecker.combined(shared)
        for key in ("left_basis", "right_basis"):
            if key in replies:
                state[key].copy_(replies[key])
        if "order" in replies:
            reordered = whole["exp_avg_sq"].index_select(-2, replies["order"].long())
            state["exp_avg_sq"].copy_(reordered[rows])

    @property
    def _factor_beta(self) -> float:
        return self.betas[1] if self.shampoo_beta is None else self.shampoo_beta

    def _rotated_step(
        self, grad: Tensor, momentum: Tensor, state: State, step: int, rows: slice | None = None
    ) -> Tensor:
        """Adam's step in the eigenbasis, ``c·M' / (√V + ε)``, updating ``V``; a member's ``rows``."""
        beta2 = self.betas[1]
        exp_avg_sq = state["exp_avg_sq"]
        rotated_grad = _project(grad, state, rows=rows)
        exp_avg_sq.mul_(beta2).addcmul_(rotated_grad, rotated_grad, value=1.0 - beta2)
        correction = (1.0 - beta2**step) ** 0.5 / (1.0 - self.betas[0] ** step)
        rotated_step = _project(momentum, state, rows=rows) / exp_avg_sq.sqrt().add_(self.eps)
        return rotated_step.mul_(correction)

    def cost(self, shape: Sequence[int]) -> UpdateCost:
        return kronecker.cost(shape, self.max_precond_dim, self.precondition_frequency, products=4)

    def team_cost(self, shape: Sequence[int], size: int) -> UpdateCost | None:
        sides = len(kronecker.preconditioned_sides(*shape[-2:], self.max_precond_dim))
        long_factor = shape[long_dim(shape)] <= self.max_precond_dim
        return kronecker.team_cost(
            shape,
            size,
            self.max_precond_dim,
            self.precondition_frequency,
            products=4,
            rounds=sides + long_factor,  # the rotated step gathered for the rotation back
            gathers=3,  # the gradient, the momentum and the rotated step
            sliced_companion=False,
        )
