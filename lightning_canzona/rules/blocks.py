"""Declared row blocks: a fused weight (QKV, gate/up, per head) updated block by block.

`RowBlockRule` wraps any `MatrixRule` and splits the whole matrix on its owner, so the plan,
gathers and scatters stay the fused weight's. docs/models.md (Fused and per-head weights) says
how blocks are stacked, where their state is kept and how their learning-rate scales apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_canzona.rules.base import MatrixRule, State, UpdateCost, state_part, store_state_part

#: ``n`` equal row blocks, or the row sizes of the blocks in order.
RowBlocks = int | tuple[int, ...]


def as_row_blocks(spec: object) -> RowBlocks:
    """``spec`` as an ``int`` or a ``tuple`` of positive ints, else a `ValueError`."""
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 1:
        return spec
    if (
        isinstance(spec, Sequence)
        and not isinstance(spec, str)
        and spec
        and all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in spec)
    ):
        return tuple(spec)
    raise ValueError(
        f"row_blocks must be a number of equal blocks >= 1 or a sequence of positive row sizes, got {spec!r}"
    )


def row_block_sizes(spec: object, rows: int) -> tuple[int, ...]:
    """The row sizes ``spec`` declares for a matrix of ``rows`` rows; `ValueError` if they do not fit."""
    blocks = as_row_blocks(spec)
    if isinstance(blocks, int):
        if rows % blocks:
            raise ValueError(f"{blocks} equal row blocks do not divide its {rows} rows")
        return (rows // blocks,) * blocks
    if sum(blocks) != rows:
        raise ValueError(f"the row sizes {blocks} sum to {sum(blocks)}, not to its {rows} rows")
    return blocks


def describe_row_blocks(blocks: Mapping[str, RowBlocks]) -> str:
    """What is split and how, for a log: one line per distinct ``row_blocks``."""
    names: dict[RowBlocks, list[str]] = {}
    for name, spec in blocks.items():
        names.setdefault(spec, []).append(name)
    lines = ["Matrices updated block by block (row_blocks):"]
    for spec, split in names.items():
        lines.append(f"  {spec!r}: {split[0]}" + (f" and {len(split) - 1} more" if len(split) > 1 else ""))
    return "\n".join(lines)


def _prefix(size: int) -> str:
    return f"rows{size}_"


@dataclass(frozen=True)
class RowBlockRule(MatrixRule):
    """``inner``, applied to each declared row block of a matrix as to a matrix of its own.

    Attributes:
        inner: The rule of each block.
        row_blocks: ``n`` equal blocks or the blocks' row sizes, along dim -2.
    """

    inner: MatrixRule
    row_blocks: RowBlocks

    @property  # type: ignore[override]
    def name(self) -> str:
        return self.inner.name

    @property  # type: ignore[override]
    def elementwise_state_keys(self) -> tuple[str, ...]:
        return self.inner.elementwise_state_keys

    @property  # type: ignore[override]
    def batches_matrices(self) -> bool:
        return self.inner.batches_matrices

    def _sizes(self, rows: int) -> dict[int, list[int]]:
        """Each distinct block size, in order, with the first rows of its blocks."""
        starts: dict[int, list[int]] = {}
        row = 0
        for size in row_block_sizes(self.row_blocks, rows):
            starts.setdefault(size, []).append(row)
            row += size
        return starts

    def init_elementwise_state(self, param: Tensor) -> State:
        return self.inner.init_elementwise_state(param)

    def prepare(self, grads: Sequence[Tensor], states: Sequence[State]) -> list[Tensor]:
        return self.inner.prepare(grads, states)

    @property
    def prepares_copies(self) -> bool:
        return self.inner.prepares_copies

    def init_matrix_state(self, shape: torch.Size, device: torch.device) -> State:
        state: State = {}
        for size, starts in self._sizes(shape[-2]).items():
            stacked = torch.Size((*shape[:-2], len(starts), size, shape[-1]))
            store_state_part(state, _prefix(size), self.inner.init_matrix_state(stacked, device))
        return state

    def direction(self, matrix: Tensor, state: State) -> Tensor:
        sizes = self._sizes(matrix.shape[-2])
        scale = self.lr_scale(matrix.shape)
        if len(sizes) == 1:  # equal blocks (per head): views in and out, no copies
            ((size, starts),) = sizes.items()
            blocks = matrix.unflatten(-2, (len(starts), size))
            return self._blocks_direction(blocks, state, scale).flatten(-3, -2)
        by_start: dict[int, Tensor] = {}
        for size, starts in sizes.items():
            blocks = torch.stack([matrix[..., start : start + size, :] for start in starts], dim=-3)
            by_start.update(zip(starts, self._blocks_direction(blocks, state, scale).unbind(-3)))
        return torch.cat([by_start[start] for start in sorted(by_start)], dim=-2)

    def _blocks_direction(self, blocks: Tensor, state: State, scale: float) -> Tensor:
        """The inner direction of a ``(…, k, size, cols)`` stack, rescaled from ``scale`` to its own."""
        size = blocks.shape[-2]
        part = state_part(state, _prefix(size))
        direction = self.inner.direction(blocks, part)
        store_state_part(state, _prefix(size), part)
        ratio = self.inner.lr_scale(blocks.shape[-2:]) / scale
        return direction if ratio == 1.0 else direction.mul(ratio)

    def apply(
        self,
        params: Sequence[Tensor],
        directions: Sequence[Tensor],
        *,
        lr: float,
        weight_decay: float,
        shapes: Sequence[Sequence[int]],
    ) -> None:
        """The inner rule's `apply` at the learning-rate scale of each matrix's first block."""
        first_blocks = [
            (*shape[:-2], row_block_sizes(self.row_blocks, shape[-2])[0], shape[-1]) for shape in shapes
        ]
        self.inner.apply(params, directions, lr=lr, weight_decay=weight_decay, shapes=first_blocks)

    def matmul_dtype(self) -> torch.dtype:
        return self.inner.matmul_dtype()

    def exchange_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.inner.exchange_dtype(param_dtype)

    def lr_scale(self, shape: Sequence[int]) -> float:
        first = row_block_sizes(self.row_blocks, shape[-2])[0]
        return self.inner.lr_scale((*shape[:-2], first, shape[-1]))

    def cost(self, shape: Sequence[int]) -> UpdateCost:
        costs = [
            self.inner.cost((*shape[:-2], len(starts), size, shape[-1]))
            for size, starts in self._sizes(shape[-2]).items()
        ]
        return UpdateCost(
            flops=sum(cost.flops for cost in costs),
            numel=sum(cost.numel for cost in costs),
            matrix_state_bytes=sum(cost.matrix_state_bytes for cost in costs),
            elementwise_state_bytes=sum(cost.elementwise_state_bytes for cost in costs),
            period=costs[0].period,
            periodic_flops=(sum(sum(cost.periodic_flops) for cost in costs),),
            working_bytes=sum(cost.working_bytes for cost in costs),
        )
