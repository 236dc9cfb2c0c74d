"""The optimizer's counters: Python numbers while it runs, 0-dim tensors in its state dicts.

Read on the host every step, tensors would wait for the device once a state dict moved them there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_canzona.rules.base import FAILURES, State


def is_counter(key: str) -> bool:
    """Whether state ``key`` holds a counter: a step count (prefixed or not) or the failures."""
    return key == "step" or key.endswith("_step") or key == FAILURES


def saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a state dict holds it: each counter a 0-dim tensor (``int64`` or ``float32``)."""
    return {
        key: torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float32)
        if is_counter(key) and isinstance(value, (int, float))
        else value
        for key, value in state.items()
    }


def running(state: dict[str, Any]) -> State:
    """``state`` as the optimizer runs with it: each counter a Python number."""
    return {key: number(value) if is_counter(key) else value for key, value in state.items()}


def number(value: Any) -> Any:
    """A counter's value as a Python number (itself if it is one)."""
    if isinstance(value, Tensor) and value.numel() == 1:
        read = value.item()  # a load or a hand-over, not a step: once
        return int(read) if not value.is_floating_point() else float(read)
    return value
