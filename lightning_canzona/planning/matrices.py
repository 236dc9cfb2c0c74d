"""What the planner knows about a matrix: its shape, its cost and the bucket it arrives in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_canzona.rules.base import UpdateCost

CostKind = Literal["flops", "numel"]
COST_KINDS: tuple[str, ...] = ("flops", "numel")


@dataclass(frozen=True)
class MatrixSpec:
    """One weight matrix (or stack of matrices) to be updated by one owner.

    Attributes:
        name: Qualified parameter name (for reports and errors).
        shape: Global shape.
        bucket: The unit its gradients arrive in (an FSDP unit or a layer); the α-balanced
            partition splits each bucket evenly when α = 0.
        cost: The rule's cost of one update of this matrix.
        holders: Ranks that hold the whole matrix in their shard (an expert of a stack that
            FSDP2 splits on the expert dimension): owned by one of them, it moves no bytes.
    """

    name: str
    shape: tuple[int, ...]
    bucket: str
    cost: UpdateCost
    holders: tuple[int, ...] = ()

    def load(self, kind: CostKind) -> float:
        """The cost the planner balances: FLOPs of the update, or elements of the matrix."""
        if kind == "flops":
            return self.cost.flops
        if kind == "numel":
            return float(self.cost.numel)
        raise ValueError(f"cost must be one of {COST_KINDS}, got {kind!r}")


def block_of(name: str) -> str:
    """The bucket of a parameter: its transformer block (``layers.3`` of ``layers.3.mlp.up.weight``),
    or its parent module when the name has no numbered block."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return ".".join(parts[:-1]) or name


def describe(
    named_shapes: Sequence[tuple[str, Sequence[int]]],
    cost_of: Callable[[Sequence[int]], UpdateCost],
    bucket_of: Callable[[str], str] = block_of,
) -> list[MatrixSpec]:
    """Matrix specs from ``(name, shape)`` pairs, a rule's cost function and a bucketing."""
    return [
        MatrixSpec(name, tuple(int(size) for size in shape), bucket_of(name), cost_of(shape))
        for name, shape in named_shapes
    ]
