"""Muon: momentum orthogonalised by Newton–Schulz (Jordan et al., 2024), as ``torch.optim.Muon``.

The momentum is elementwise state on the shards (`MuonRule.prepare`); the owner orthogonalises the
whole matrix (`MuonRule.direction`). The update, its cost and its team form: docs/optimizers.md#muon.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_canzona.compat import cpu_multiplies_bfloat16, foreach_lerp, foreach_lerp_
from lightning_canzona.rules.base import (
    MatrixRule,
    Rule,
    State,
    TeamComputation,
    UpdateCost,
    check_non_negative,
    check_positive_int,
    check_unit_interval,
    ieee_float32_products,
    matrix_dims,
    setting,
)
from lightning_canzona.rules.newton_schulz import (
    FORMS,
    Compile,
    NewtonSchulzSchedule,
    check_compile,
    compiles,
    newton_schulz,
    resolve_schedule,
    team_newton_schulz,
    team_work,
)
from lightning_canzona.rules.newton_schulz import flops as newton_schulz_flops
from lightning_canzona.rules.newton_schulz import working_bytes as newton_schulz_working_bytes

ADJUST_LR_FNS = ("original", "match_rms_adamw")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """A compute dtype from its name or itself; ``"auto"`` is `auto_dtype` of ``device`` (default CPU)."""
    if dtype == "auto":
        return auto_dtype(torch.device("cpu") if device is None else device)
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"compute_dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")


def auto_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where ``device`` multiplies it in hardware, float32 where it would be emulated."""
    if device.type == "cuda":
        fast = torch.cuda.is_bf16_supported(including_emulation=False)
    elif device.type == "cpu":
        fast = cpu_multiplies_bfloat16()
    else:
        fast = True
    return torch.bfloat16 if fast else torch.float32


@dataclass(frozen=True)
class MuonRule(MatrixRule):
    """Muon's per-matrix math and settings (``ns_coefficients`` becomes ``schedule``)."""

    schedule: NewtonSchulzSchedule = setting((3.4445, -4.7750, 2.0315), key="ns_coefficients")
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    eps: float = 1e-7
    adjust_lr_fn: str | None = None
    compute_dtype: torch.dtype = setting(torch.bfloat16, group_default="auto")
    ns_form: str = "standard"
    compile: Compile = setting(False, group_default="auto")
    name = "muon"
    elementwise_state_keys = ("momentum_buffer",)
    batches_matrices = True

    def __post_init__(self) -> None:
        check_positive_int(ns_steps=self.ns_steps)
        check_unit_interval(momentum=self.momentum)
        check_non_negative(eps=self.eps)
        adjust_lr_fn = self.adjust_lr_fn or "original"
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(
                f"Adjust learning rate function {adjust_lr_fn} is not supported: adjust_lr_fn must be one "
                f"of {ADJUST_LR_FNS} or None"
            )
        if self.ns_form not in FORMS:
            raise ValueError(f"ns_form must be one of {FORMS}, got {self.ns_form!r}")
        object.__setattr__(self, "adjust_lr_fn", adjust_lr_fn)
        object.__setattr__(self, "schedule", resolve_schedule(self.schedule))
        object.__setattr__(self, "compute_dtype", resolve_dtype(self.compute_dtype))
        check_compile(self.compile)

    @classmethod
    def from_group(cls: type[Rule], group: Mapping[str, Any], **values: Any) -> Rule:
        device = group["params"][0].device if group["params"] else None
        dtype = resolve_dtype(group["compute_dtype"], device)
        return super().from_group(group, **{"compute_dtype": dtype, **values})

    def init_elementwise_state(self, param: Tensor) -> State:
        return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}

    def prepare(self, grads: Sequence[Tensor], states: Sequence[State]) -> list[Tensor]:
        buffers = [state["momentum_buffer"] for state in states]
        grads = list(grads)
        foreach_lerp_(buffers, grads, 1.0 - self.momentum)
        return list(foreach_lerp(grads, buffers, self.momentum)) if self.nesterov else buffers

    @property
    def prepares_copies(self) -> bool:
        return self.nesterov

    def init_matrix_state(self, shape: torch.Size, device: torch.device) -> State:
        return {}

    @ieee_float32_products
    def direction(self, matrix: Tensor, state: State) -> Tensor:
        compile = compiles(self.compile, matrix.device)
        return newton_schulz(
            matrix, self.schedule, self.ns_steps, self.eps, self.compute_dtype, self.ns_form, compile
        )

    def matmul_dtype(self) -> torch.dtype:
        return self.compute_dtype

    def exchange_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        # Newton–Schulz starts by rounding to compute_dtype and returns compute_dtype: sending bf16
        # both ways halves the traffic and changes no bit of the result.
        return self.compute_dtype

    def lr_scale(self, shape: Sequence[int]) -> float:
        _, rows, cols = matrix_dims(shape)
        if self.adjust_lr_fn == "match_rms_adamw":
            return 0.2 * math.sqrt(max(rows, cols))
        return math.sqrt(max(1.0, rows / cols))

    def cost(self, shape: Sequence[int]) -> UpdateCost:
        batch, rows, cols = matrix_dims(shape)
        numel = batch * rows * cols
        return UpdateCost(
            flops=batch * newton_schulz_flops(rows, cols, self.ns_steps, self.ns_form),
            numel=numel,
            matrix_state_bytes=0,
            elementwise_state_bytes=4 * numel,
            working_bytes=batch
            * newton_schulz_working_bytes(min(rows, cols), max(rows, cols), self.compute_dtype),
        )

    def team_cost(self, shape: Sequence[int], size: int) -> UpdateCost | None:
        batch, rows, cols = matrix_dims(shape)
        if size > min(rows, cols):
            return None
        work = team_work(rows, cols, self.ns_steps, self.ns_form, size, self.compute_dtype)
        return UpdateCost(
            flops=batch * work.flops,
            numel=batch * min(rows, cols) * -(-max(rows, cols) // size),
            matrix_state_bytes=0,
            elementwise_state_bytes=4 * batch * rows * cols,
            team_messages=work.collectives,
            team_numel=batch * work.numel,
            working_bytes=batch
            * newton_schulz_working_bytes(min(rows, cols), -(-max(rows, cols) // size), self.compute_dtype),
        )

    @ieee_float32_products
    def team_direction(
        self, matrix: Tensor, shape: Sequence[int], member: int, size: int, state: State
    ) -> TeamComputation:
        return team_newton_schulz(
            matrix,
            shape,
            self.schedule,
            self.ns_steps,
            self.eps,
            self.compute_dtype,
            member,
            size,
            self.ns_form,
        )
