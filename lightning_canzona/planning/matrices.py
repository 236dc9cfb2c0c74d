"""What the planner knows about a matrix: its shape, its cost and the bucket it arrives in."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

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


# Teams
#
# Teams: ranks that compute one matrix's update together (beyond the paper).
#
# Whole-matrix ownership stops scaling where one matrix's update costs more than a rank's fair share
# of the step: the step can then never be shorter than that matrix alone. A rule whose update
# splits exactly (`MatrixRule.team_cost`) lets a *team* of ``k`` ranks compute it: each member
# holds one slice of the matrix along its long dimension (`geometry.member_blocks`) and the members combine
# small partial results through collectives among themselves.
#
# Teams are aligned blocks of consecutive ranks (`candidate_teams`): few distinct teams, so few
# process groups, and on a ``dp × tp`` mesh whose ``tp`` ranks share a node a team of up to ``tp``
# ranks stays within the node. How a team slices a matrix is `lightning_canzona.geometry`'s.


#: The team sizes the planner considers (powers of two, so that aligned blocks nest).
TEAM_SIZES: tuple[int, ...] = (2, 4, 8, 16, 32, 64)


@functools.cache
def candidate_teams(num_ranks: int, size: int) -> tuple[tuple[int, ...], ...]:
    """The aligned blocks of ``size`` consecutive ranks among ``num_ranks``."""
    return tuple(tuple(range(start, start + size)) for start in range(0, num_ranks - size + 1, size))


def local_members(
    team: tuple[int, ...], member_loads: Sequence[Hashable], held: Sequence[Sequence[int]]
) -> tuple[int, ...]:
    """``team``'s ranks in a member order that computes each slice where it lies, as far as the
    plan's balance allows.

    Members whose loads are alike may trade ranks without changing any rank's load; within each
    such class the members, in order, take the rank of the class that holds most of their slice
    (ties: the plan's own). Where a team is all the ranks that hold a matrix, sharded along the
    long side as the slices are (FSDP2 or tensor parallelism on a small mesh), the slices then
    need not travel at all.

    Args:
        team: The ranks of the team, in the plan's member order.
        member_loads: What each member costs its rank (on every step the plan balances).
        held: Per member, the elements of its slice that each rank of ``team`` holds.
    """
    ranks = list(team)
    classes: dict[Hashable, list[int]] = {}
    for member, load in enumerate(member_loads):
        classes.setdefault(load, []).append(member)
    for members in classes.values():
        free = list(members)  # positions in ``team`` whose ranks the class may hand out
        for member in members:
            position = max(free, key=lambda p: (held[member][p], p == member, -p))
            free.remove(position)
            ranks[member] = team[position]
    return tuple(ranks)
