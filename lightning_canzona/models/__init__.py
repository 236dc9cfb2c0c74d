"""Models: a Qwen3-style decoder with presets, and the Lightning language-model module."""

from lightning_canzona.models.language_model import CausalLanguageModel
from lightning_canzona.models.qwen3 import (
    PRESETS,
    Qwen3,
    Qwen3Config,
    tensor_parallel_constraints,
    tensor_parallel_plan,
)

__all__ = [
    "PRESETS",
    "CausalLanguageModel",
    "Qwen3",
    "Qwen3Config",
    "tensor_parallel_constraints",
    "tensor_parallel_plan",
]
