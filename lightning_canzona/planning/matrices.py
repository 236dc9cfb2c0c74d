"""What the planner knows about a matrix: its shape, its cost and the bucket it arrives in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from lightning_canzona.planning.teams import TEAM_SIZES
from lightning_canzona.rules.base import MatrixRule, UpdateCost, matrix_shape

CostKind = Literal["flops", "numel"]
COST_KINDS: tuple[str, ...] = ("flops", "numel")
#: Which step a load is of (`MatrixSpec.member_loads`).
Step = Literal["amortised", "steady", "peak"]


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
        team_costs: The busiest member's cost when a team of each of `teams.TEAM_SIZES` ranks
            computes the update together (``None``: the rule cannot split it; empty: none can).
    """

    name: str
    shape: tuple[int, ...]
    bucket: str
    cost: UpdateCost
    holders: tuple[int, ...] = ()
    team_costs: tuple[UpdateCost | None, ...] = ()

    def weighted(self, factor: float) -> MatrixSpec:
        """This spec with its FLOPs, alone and in teams, counted ``factor`` times
        (`UpdateCost.weighted`)."""
        teams = tuple(cost.weighted(factor) if cost is not None else None for cost in self.team_costs)
        return replace(self, cost=self.cost.weighted(factor), team_costs=teams)

    def member_cost(self, team: int = 1) -> UpdateCost:
        """The cost to each member of a team of ``team`` ranks (the whole cost for one)."""
        if team == 1:
            return self.cost
        cost = dict(zip(TEAM_SIZES, self.team_costs)).get(team)
        if cost is None:
            raise ValueError(f"{self.name} (shape {self.shape}) cannot be split over {team} ranks")
        return cost

    def team_sizes(self) -> tuple[int, ...]:
        """The team sizes (beyond 1) that can compute this matrix together."""
        return tuple(size for size, cost in zip(TEAM_SIZES, self.team_costs) if cost is not None)

    def load(self, kind: CostKind, team: int = 1) -> float:
        """The cost the planner balances, to the busiest member of a team of ``team``: FLOPs of
        the update, or elements of the matrix."""
        return max(self.member_loads(kind, team))

    def member_loads(self, kind: CostKind, team: int = 1, step: Step = "amortised") -> tuple[float, ...]:
        """The cost to each member of a team of ``team``, in member order (members differ in
        FLOPs where single members carry a decomposition: `UpdateCost.member_flops`), on the
        ``step``: any, with the periodic work amortised, one that runs it (``"peak"``), or one
        that does not (``"steady"``)."""
        cost = self.member_cost(team)
        if kind == "flops":
            if step == "amortised":
                return tuple(cost.member_flops_of(member) for member in range(team))
            return tuple(cost.step_flops_of(member, step == "peak") for member in range(team))
        if kind == "numel":
            return (float(cost.numel),) * team
        raise ValueError(f"cost must be one of {COST_KINDS}, got {kind!r}")


def matrix_spec(
    name: str, shape: Sequence[int], rule: MatrixRule, bucket: str | None = None, holders: Sequence[int] = ()
) -> MatrixSpec:
    """The spec of a matrix of ``shape`` updated by ``rule``, with its team costs (a
    convolution's weight costs what its `matrix_shape` does, and is computed by one rank)."""
    shape = tuple(int(size) for size in shape)
    teams = tuple(rule.team_cost(shape, size) for size in TEAM_SIZES) if len(shape) <= 3 else ()
    return MatrixSpec(
        name,
        shape,
        block_of(name) if bucket is None else bucket,
        rule.cost(matrix_shape(shape)),
        tuple(holders),
        teams,
    )


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
    rule: MatrixRule,
    bucket_of: Callable[[str], str] = block_of,
) -> list[MatrixSpec]:
    """Matrix specs from ``(name, shape)`` pairs, the rule that updates them and a bucketing."""
    return [matrix_spec(name, shape, rule, bucket_of(name)) for name, shape in named_shapes]
