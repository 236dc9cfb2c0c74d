"""NorMuon: Muon's update normalised per output neuron (Li et al., 2025), in dion's form.

Each row of Muon's orthogonalised update is divided by the root of its running second moment
(matrix state on the owner), then the update is scaled back to Muon's Frobenius norm:
docs/optimizers.md#normuon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lightning_canzona.rules.base import State, UpdateCost, check_unit_interval, matrix_dims
from lightning_canzona.rules.muon import MuonRule

#: Added to the neurons' root second moments, and the least Frobenius norm divided by.
EPSILON = 1e-8
#: The matrix-state key of the neurons' second moments: ``(…, m, 1)`` float32.
ROW_SECOND_MOMENT = "row_second_moment"


def normalize_rows(orthogonal: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """``orthogonal`` with each row divided by its root second moment, rescaled to its Frobenius norm;
    updates ``second_moment`` (``(…, m, 1)``) in place, computing in its dtype."""
    orthogonal = orthogonal.to(second_moment.dtype)
    second_moment.lerp_(orthogonal.square().mean(dim=-1, keepdim=True), 1.0 - beta2)
    normalized = orthogonal / (second_moment.sqrt() + EPSILON)
    norm = torch.linalg.vector_norm(orthogonal, dim=(-2, -1), keepdim=True)
    normalized_norm = torch.linalg.vector_norm(normalized, dim=(-2, -1), keepdim=True)
    return normalized * (norm / normalized_norm.clamp_min(EPSILON))


@dataclass(frozen=True)
class NorMuonRule(MuonRule):
    """NorMuon's per-matrix math: Muon's settings and ``beta2``."""

    beta2: float = 0.95
    name = "normuon"
    # Each matrix keeps its own moment: the engine gives every matrix of a stack its own call.
    batches_matrices = False

    def __post_init__(self) -> None:
        check_unit_interval(beta2=self.beta2)
        super().__post_init__()

    def init_matrix_state(self, shape: torch.Size, device: torch.device) -> State:
        *batch, rows, _ = shape
        return {ROW_SECOND_MOMENT: torch.zeros(*batch, rows, 1, dtype=torch.float32, device=device)}

    def direction(self, matrix: Tensor, state: State) -> Tensor:
        orthogonal = super().direction(matrix, state)
        # Returned in Muon's compute dtype, which is what travels back to the shards.
        return normalize_rows(orthogonal, state[ROW_SECOND_MOMENT], self.beta2).to(orthogonal.dtype)

    def cost(self, shape: Sequence[int]) -> UpdateCost:
        batch, rows, cols = matrix_dims(shape)
        muon = super().cost(shape)
        return replace(muon, flops=muon.flops + 8 * batch * rows * cols, matrix_state_bytes=4 * batch * rows)

    def team_cost(self, shape: Sequence[int], size: int) -> UpdateCost | None:
        return None
