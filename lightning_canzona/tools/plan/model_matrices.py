"""The matrices of a Qwen3 preset under a matrix rule, from shapes alone (meta device)."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import torch

from lightning_canzona.models.qwen3 import Qwen3
from lightning_canzona.optim.param_groups import matrix_param_groups
from lightning_canzona.planning.devices import DeviceModel
from lightning_canzona.planning.matrices import MatrixSpec, describe
from lightning_canzona.planning.plan import PlanSettings
from lightning_canzona.rules import MatrixRule, MuonRule, RowBlockRule, ShampooRule, SOAPRule
from lightning_canzona.rules.blocks import RowBlocks
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
    """Dtype of the rule's matmuls (`MatrixRule.matmul_dtype`), by name."""
    return str(rule.matmul_dtype()).removeprefix("torch.")


def rule_settings(settings: PlanSettings, device: DeviceModel, rule: MatrixRule) -> PlanSettings:
    """``settings`` with ``device``'s prices of collectives in FLOPs of ``rule``'s matmuls (what
    ``team_prices="h100"`` gives the optimizer on an H100)."""
    return device.repriced(settings, rule.matmul_dtype())


@cache
def preset_shapes(preset: str) -> tuple[tuple[tuple[str, tuple[int, ...], RowBlocks | None], ...], int]:
    """``((name, shape, row_blocks) of every matrix parameter, total parameter count)`` of a preset.

    ``row_blocks`` is what `matrix_param_groups` declares (the experts' fused gate/up halves), or
    ``None``. Built on the meta device: no memory, no weights. Cached because large presets take
    seconds to construct and a sweep asks for each several times.
    """
    with torch.device("meta"):
        model = Qwen3(preset)
    named = tuple(
        (name, tuple(param.shape), group.get("row_blocks"))
        for group in matrix_param_groups(model)
        if "algorithm" not in group
        for name, param in group["params"]
    )
    return named, sum(param.numel() for param in model.parameters())


def preset_matrices(preset: str, rule: MatrixRule, dp: int = 1, tp: int = 1) -> tuple[list[MatrixSpec], int]:
    """The preset's matrix specs under ``rule`` on a ``dp × tp`` mesh, and its parameter count.

    As the engine plans them, each expert of a ``[experts, rows, cols]`` stack is a spec of its
    own, held whole by the ranks where
    FSDP2 puts it: its ``Shard(0)`` chunk of the experts on a data-parallel coordinate, on every
    tensor-parallel rank there (the stacks are not split over TP).
    """
    named, num_params = preset_shapes(preset)
    specs = []
    for name, shape, row_blocks in named:
        matrix_rule = rule if row_blocks is None else RowBlockRule(rule, row_blocks)
        (spec,) = describe([(name, shape)], matrix_rule)
        if len(spec.shape) != 3:
            specs.append(spec)
            continue
        experts, matrix = spec.shape[0], spec.shape[1:]
        chunk = -(-experts // dp)
        specs += [
            replace(
                spec,
                name=f"{spec.name}[{expert}]",
                shape=matrix,
                cost=matrix_rule.cost(matrix),
                team_costs=(),
                holders=tuple((expert // chunk) * tp + t for t in range(tp)),
            )
            for expert in range(experts)
        ]
    return specs, num_params
