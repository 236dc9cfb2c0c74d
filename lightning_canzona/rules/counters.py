"""The optimizer's counters: Python numbers while it runs, 0-dim tensors in its state dicts.

Step counts (AdamW's, Shampoo's and SOAP's, of every row block and every matrix of a stack) and
decomposition-failure counts are read on the host every step. Held as tensors they would move to
the GPU with a loaded state dict (``torch.optim.Optimizer.load_state_dict`` moves every key but
``"step"``, and a prefixed ``"stack0_step"`` is not ``"step"``) or with a team's hand-over, and
every read would wait for the device. So the running state holds Python numbers, and a state
dict holds the tensors it always held (`saved`): an ``int64`` for an integer count, a ``float32``
for AdamW's step, which checkpoints of any age load back as numbers (`running`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_canzona.rules.base import FAILURES, State


def is_counter(key: str) -> bool:
    """Whether state ``key`` holds a counter: a step count (``"step"``, or a prefixed one of a row
    block or a stack's matrix) or the decomposition failures."""
    return key == "step" or key.endswith("_step") or key == FAILURES


def saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a state dict holds it: each counter a 0-dim tensor (an ``int`` as ``int64``, a
    ``float`` as ``float32``), the rest as it is (a new dict; ``state`` is unchanged)."""
    return {
        key: torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float32)
        if is_counter(key) and isinstance(value, (int, float))
        else value
        for key, value in state.items()
    }


def running(state: dict[str, Any]) -> State:
    """``state`` as the optimizer runs with it: each counter that a state dict held as a 0-dim
    tensor a Python number (an ``int`` from an integer tensor, else a ``float``)."""
    return {key: number(value) if is_counter(key) else value for key, value in state.items()}


def number(value: Any) -> Any:
    """A counter's value as a Python number (itself if it is one)."""
    if isinstance(value, Tensor) and value.numel() == 1:
        read = value.item()  # a load or a hand-over, not a step: once
        return int(read) if not value.is_floating_point() else float(read)
    return value
