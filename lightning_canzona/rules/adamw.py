"""AdamW for every parameter that is not a weight matrix: ``torch.optim.AdamW``'s algorithm, on shards."""

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


#: AdamW's elementwise state: what ``state_dtype`` keeps in another dtype than the parameter's.
MOMENTS = ("exp_avg", "exp_avg_sq")


def init_adamw_state(param: Tensor) -> State:
    """Step counter (a Python number) and both moments."""
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
    """One AdamW step of ``params`` in place, ``torch.optim.AdamW``'s operations as one foreach call each."""
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
