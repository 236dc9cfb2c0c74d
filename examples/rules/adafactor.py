"""A matrix optimizer of your own: Adafactor's factored second moment as a `MatrixRule`.

Adafactor (Shazeer & Stern, 2018) keeps, per weight matrix, one running mean of the squared
gradient per row and one per column, instead of one per entry, and scales the gradient by their
outer product. Both means run over the *whole* matrix — which no FSDP2 or tensor-parallel shard
holds — so, distributed, it needs what lightning_canzona gives every rule: each matrix computed
once, whole, by an owner the plan chooses. This file is all it takes; nothing in the package
changes. ``tests/distributed/test_own_rule.py`` distributes it on dp 2 × tp 2 against one process
and saves at one mesh, loads at another.

    optimizer = Adafactor(lc.matrix_param_groups(model), lr=1e-2)

For gradient ``G`` (``m × n``), ``β₂`` and learning rate ``γ``, with ``ε₁ = 1e-30``::

    R ← β₂·R + (1 − β₂)·mean_j(G² + ε₁)      C ← β₂·C + (1 − β₂)·mean_i(G² + ε₁)   (m and n entries)
    U = G / √(R·Cᵀ / mean(R))                 D = U / max(1, RMS(U) / d)            (update clipping d)
    W ← W·(1 − γλ) − γ·D
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_canzona.optim import MatrixOptimizer
from lightning_canzona.rules import MatrixRule, State, UpdateCost, matrix_dims


@dataclass(frozen=True)
class AdafactorRule(MatrixRule):
    """Adafactor without momentum, per matrix: each matrix of an expert stack gets its own call
    and its own state from the engine."""

    beta2: float = 0.999
    clip_threshold: float = 1.0
    name = "adafactor"

    def init_matrix_state(self, shape: torch.Size, device: torch.device) -> State:
        # Matrix state: the owner of the matrix holds it whole, and checkpoints move it to
        # whoever owns the matrix at the mesh they are loaded at.
        # A shape may have leading batch dimensions (a fused weight's row blocks, stacked).
        *batch, rows, cols = shape
        return {
            "row": torch.zeros(*batch, rows, device=device),
            "col": torch.zeros(*batch, cols, device=device),
        }

    def direction(self, matrix: Tensor, state: State) -> Tensor:
        # The whole matrix, on its owner: a pure function of it and the state (no collective).
        grad = matrix.float()
        squared = grad.square() + 1e-30
        state["row"].lerp_(squared.mean(dim=-1), 1.0 - self.beta2)
        state["col"].lerp_(squared.mean(dim=-2), 1.0 - self.beta2)
        # 1 / √(R·Cᵀ / mean(R)) as two factors: the product of two means of ε₁ would underflow.
        row_factor = (state["row"] / state["row"].mean(dim=-1, keepdim=True)).rsqrt()
        update = grad * row_factor[..., :, None] * state["col"].rsqrt()[..., None, :]
        rms = update.square().mean(dim=(-2, -1), keepdim=True).sqrt()
        return update / (rms / self.clip_threshold).clamp_min(1.0)

    def cost(self, shape: Sequence[int]) -> UpdateCost:
        # What the planner balances: FLOPs of `direction`, elements moved, bytes of state.
        batch, rows, cols = matrix_dims(shape)
        return UpdateCost(
            flops=12 * batch * rows * cols,
            numel=batch * rows * cols,
            matrix_state_bytes=4 * batch * (rows + cols),
            elementwise_state_bytes=0,
        )


class Adafactor(MatrixOptimizer):
    """Adafactor for weight matrices, AdamW for everything else.

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param groups (`lc.matrix_param_groups`).
        lr: Learning rate γ.
        weight_decay: Decoupled weight decay λ.
        beta2: Decay of the row and column means of the squared gradient.
        clip_threshold: Update clipping ``d``: the update's RMS is at most this.
        **kwargs: The AdamW groups' settings, ``plan`` and the rest (`MatrixOptimizer`).
    """

    algorithm = "adafactor"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        beta2: float = 0.999,
        clip_threshold: float = 1.0,
        **kwargs: Any,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, beta2=beta2, clip_threshold=clip_threshold)
        super().__init__(params, defaults, **kwargs)

    def matrix_rule(self, group: dict[str, Any]) -> AdafactorRule:
        return AdafactorRule(beta2=group["beta2"], clip_threshold=group["clip_threshold"])
