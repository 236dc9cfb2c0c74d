"""AdamW for every parameter that is not a weight matrix (Loshchilov & Hutter, 2019).

Purely elementwise, so it runs on shards as they lie (DTensor or plain) and needs no owner::

    W ← W·(1 − γλ)
    M ← β₁·M + (1 − β₁)·G          V ← β₂·V + (1 − β₂)·G⊙G
    W ← W − γ/(1 − β₁ᵗ) · M / (√V / √(1 − β₂ᵗ) + ε)

This is ``torch.optim.AdamW``'s single-tensor algorithm, operation for operation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_canzona.rules.base import State

ALGORITHM = "adamw"


def init_adamw_state(param: Tensor) -> State:
    """Step counter (on the host, so reading it never syncs a device) and both moments."""
    return {
        "step": torch.zeros((), dtype=torch.float32),
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


def adamw_step(
    param: Tensor,
    grad: Tensor,
    state: State,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step of ``param`` in place."""
    beta1, beta2 = betas
    state["step"] += 1
    step = float(state["step"])
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / (1.0 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
