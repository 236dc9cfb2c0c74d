"""NorMuon: Muon's orthogonalised update, normalised per output neuron (Li et al., 2025).

For a matrix ``W`` (``m × n``, one row per output neuron) and Muon's ``O = NS_k(M)`` (see
`lightning_canzona.rules.muon`), with ``β₂`` the decay of the neurons' second moments::

    v ← β₂·v + (1 − β₂)·mean_j(O ⊙ O)           (one entry per row: matrix state on the owner)
    Ô = O / (√v + ε)                              (each row by its own, ε = 1e-8)
    D = Ô · ‖O‖_F / max(‖Ô‖_F, ε)                 (the orthogonalised update's Frobenius norm kept)
    W ← W·(1 − γλ) − γ·s(m, n)·D                  (Muon's learning-rate scale s)

Muon's orthogonalisation leaves some neurons with much larger updates than others; the second
moment evens them out, and the rescale keeps the step's size Muon's, so Muon's learning rates and
``adjust_lr_fn`` carry over. This is the update of the NorMuon paper (arXiv 2510.05491, Algorithm
1) in the form of microsoft/dion's ``NorMuon`` (``dion/normuon.py``: the moment starts at zero
without bias correction; the norm is restored, then the shape scale applied). dion normalises
each rank's shard of a sharded matrix by its own rows' and its own Frobenius norm; here the owner
holds the whole matrix, so the update is the one-process one on every mesh.

A stack of matrices (experts) keeps one moment per matrix; a fused weight with row blocks
(`lightning_canzona.rules.blocks`) normalises each block as the matrix it would be alone.

Cost per step: Muon's, and ``≈ 8·mn`` FLOPs of normalisation (in float32); the moment (``m``
float32 elements) is matrix state. No team form: every matrix is updated whole by one owner.
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
    """``orthogonal`` (``(…, m, n)``) with each row divided by the root of its running second
    moment, then scaled back to its Frobenius norm; updates ``second_moment`` (``(…, m, 1)``) in
    place. Computes in ``second_moment``'s dtype."""
    orthogonal = orthogonal.to(second_moment.dtype)
    second_moment.lerp_(orthogonal.square().mean(dim=-1, keepdim=True), 1.0 - beta2)
    normalized = orthogonal / (second_moment.sqrt() + EPSILON)
    norm = torch.linalg.vector_norm(orthogonal, dim=(-2, -1), keepdim=True)
    normalized_norm = torch.linalg.vector_norm(normalized, dim=(-2, -1), keepdim=True)
    return normalized * (norm / normalized_norm.clamp_min(EPSILON))


@dataclass(frozen=True)
class NorMuonRule(MuonRule):
    """NorMuon's per-matrix math (see the module docstring for the formulas): Muon's settings and
    ``beta2``."""

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
