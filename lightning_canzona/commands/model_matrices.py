"""The matrices of a Qwen3 preset under a matrix rule, from shapes alone (meta device)."""

from __future__ import annotations

from functools import cache

import torch

from lightning_canzona.models.qwen3 import Qwen3
from lightning_canzona.optim.param_groups import matrix_param_groups
from lightning_canzona.planning.matrices import MatrixSpec, describe
from lightning_canzona.rules import MatrixRule, MuonRule, ShampooRule, SOAPRule
from lightning_canzona.rules.newton_schulz import PRESETS as SCHEDULES

OPTIMIZERS: tuple[str, ...] = ("muon", "shampoo", "soap")


def make_rule(optimizer: str) -> MatrixRule:
    """The rule of ``optimizer`` with the defaults of the optimizer class users construct."""
    if optimizer == "muon":
        return MuonRule(SCHEDULES["quintic"])
    if optimizer == "shampoo":
        return ShampooRule()
    if optimizer == "soap":
        return SOAPRule()
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")


def compute_dtype(rule: MatrixRule) -> str:
    """Dtype of the rule's matmuls: Muon's ``compute_dtype``; Shampoo and SOAP work in float32."""
    dtype = rule.compute_dtype if isinstance(rule, MuonRule) else torch.float32
    return str(dtype).removeprefix("torch.")


@cache
def preset_shapes(preset: str) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], int]:
    """``((name, shape) of every matrix parameter, total parameter count)`` of a preset.

    Built on the meta device: no memory, no weights. Cached because large presets take seconds to
    construct and a sweep asks for each several times.
    """
    with torch.device("meta"):
        model = Qwen3(preset)
    named = tuple((name, tuple(param.shape)) for name, param in matrix_param_groups(model)[0]["params"])
    return named, sum(param.numel() for param in model.parameters())


def preset_matrices(preset: str, rule: MatrixRule) -> tuple[list[MatrixSpec], int]:
    """The preset's matrix specs under ``rule``, and its total parameter count."""
    named, num_params = preset_shapes(preset)
    return describe(named, rule.cost), num_params
