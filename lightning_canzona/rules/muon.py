"""Muon: momentum, orthogonalised by Newton–Schulz (Jordan et al., 2024).

For gradient ``G`` of an ``m × n`` weight, momentum ``μ`` and learning rate ``γ``::

    B ← μ·B + (1 − μ)·G                        (elementwise, on shards)
    M ← (1 − μ)·G + μ·B  if nesterov else B    (elementwise, on shards)
    O ← NS_k(M)                                (full matrix, on the owner)
    W ← W·(1 − γλ) − γ·s(m, n)·O

with ``s = √max(1, m/n)`` (``"original"``) or ``0.2·√max(m, n)`` (``"match_rms_adamw"``, which makes
the update's RMS match AdamW's). This is ``torch.optim.Muon``'s algorithm, keyword for keyword.

A team of ``t`` ranks can compute one matrix's update together
(`newton_schulz.team_newton_schulz`): each member multiplies its ``1/t`` of ``X``, the members
sum ``a × a`` Gram matrices (once per step in the standard form, once per restart in the Gram
form); `newton_schulz.team_work` counts the FLOPs and collectives.

Cost per step: ``k·(4a²b + 2a³)`` FLOPs with ``a = min(m, n)``, ``b = max(m, n)``, ``k`` = ns_steps
(the standard form; the others cost `newton_schulz.flops`);
``m·n`` elements moved; the momentum buffer (``m·n`` parameter-dtype elements) is elementwise state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_canzona.compat import foreach_lerp, foreach_lerp_
from lightning_canzona.rules.base import MatrixRule, State, TeamComputation, UpdateCost, matrix_dims
from lightning_canzona.rules.compiled import Compile, compiles
from lightning_canzona.rules.ieee import ieee_float32_products
from lightning_canzona.rules.newton_schulz import (
    NewtonSchulzSchedule,
    newton_schulz,
    team_newton_schulz,
    team_work,
)
from lightning_canzona.rules.newton_schulz import flops as newton_schulz_flops

ADJUST_LR_FNS = ("original", "match_rms_adamw")


@dataclass(frozen=True)
class MuonRule(MatrixRule):
    """Muon's per-matrix math (see the module docstring for the formulas)."""

    schedule: NewtonSchulzSchedule
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    eps: float = 1e-7
    adjust_lr_fn: str = "original"
    compute_dtype: torch.dtype = torch.bfloat16
    ns_form: str = "standard"
    compile: Compile = False
    name = "muon"
    elementwise_state_keys = ("momentum_buffer",)
    batches_matrices = True

    def init_elementwise_state(self, param: Tensor) -> State:
        return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}

    def prepare(self, grads: Sequence[Tensor], states: Sequence[State]) -> list[Tensor]:
        buffers = [state["momentum_buffer"] for state in states]
        grads = list(grads)
        foreach_lerp_(buffers, grads, 1.0 - self.momentum)
        return list(foreach_lerp(grads, buffers, self.momentum)) if self.nesterov else buffers

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
