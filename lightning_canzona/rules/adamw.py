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

from lightning_canzona.compat import (
    foreach_add_,
    foreach_addcdiv_,
    foreach_addcmul_,
    foreach_div_,
    foreach_lerp_,
    foreach_sqrt,
)
from lightning_canzona.rules.base import State, scale_

ALGORITHM = "adamw"


def init_adamw_state(param: Tensor) -> State:
    """Step counter (a Python number: see `lightning_canzona.rules.counters`) and both moments."""
    return {
        "step": 0.0,
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


def adamw_step(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[State],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step of each of ``params`` in place (one param group's hyperparameters); counts
    the step in each of ``states``.

    The operations are ``torch.optim.AdamW``'s single-tensor ones, in the same order, each applied
    to all the tensors by one ``torch._foreach_*`` call: one kernel launch per operation instead
    of one per operation and parameter (the hundreds of norms and biases of an LLM), with the
    same result bit for bit, bf16 and fp16 tensors included (`rules.base.scale_`).
    """
    if not params:
        return
    beta1, beta2 = betas
    counts = []
    for state in states:
        state["step"] += 1
        counts.append(state["step"])
    exp_avgs = [state["exp_avg"] for state in states]
    exp_avg_sqs = [state["exp_avg_sq"] for state in states]
    scale_(params, 1.0 - lr * weight_decay)
    foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    scale_(exp_avg_sqs, beta2)
    foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denominators = foreach_sqrt(exp_avg_sqs)
    foreach_div_(denominators, [(1.0 - beta2**count) ** 0.5 for count in counts])
    foreach_add_(denominators, eps)
    foreach_addcdiv_(params, exp_avgs, denominators, [-lr / (1.0 - beta1**count) for count in counts])
