"""What the planner knows about a matrix: its shape, its cost and the bucket it arrives in."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from lightning_canzona.rules.base import MatrixRule, UpdateCost, matrix_shape

CostKind = Literal["flops", "numel"]
COST_KINDS: tuple[str, ...] = ("flops", "numel")
#: Which step a load is of (`MatrixSpec.member_loads`).
Step = Literal["amortised", "steady", "peak"]


@dataclass(frozen=True)
class MatrixSpec:
    """One weight matrix (or stack of matrices) to be updated by one owner.

    Attributes:
        bucket: The unit its gradients arrive in (an FSDP unit or a layer), which α = 0 spreads.
        cost: The rule's cost of one update of this matrix.
        holders: Ranks that hold the whole matrix (an expert that FSDP2 left on one rank).
        team_costs: The cost to a team of each of `TEAM_SIZES` ranks (``None``: the rule cannot
            split it; empty: none can).
        param_bytes: Bytes of one element of the parameter.
        prepared_bytes: Bytes of one element of what the rule's `prepare` makes anew (0: it hands
            back the gradient or its state).
        exchange_bytes: Bytes of one element as the matrix travels and is computed on
            (`MatrixRule.exchange_dtype`).
        batched: An owner's matrices of its shape go through one call of the rule together
            (`MatrixRule.batches_matrices`): their working sets add up.
    """

    name: str
    shape: tuple[int, ...]
    bucket: str
    cost: UpdateCost
    holders: tuple[int, ...] = ()
    team_costs: tuple[UpdateCost | None, ...] = ()
    param_bytes: int = 4
    prepared_bytes: int = 4
    exchange_bytes: int = 4
    batched: bool = True

    def weighted(self, factor: float) -> MatrixSpec:
        """This spec with its FLOPs, alone and in teams, counted ``factor`` times."""
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
        """The cost the planner balances (FLOPs or elements) to a team of ``team``'s busiest member."""
        return max(self.member_loads(kind, team))

    def member_loads(self, kind: CostKind, team: int = 1, step: Step = "amortised") -> tuple[float, ...]:
        """The cost to each member of a team of ``team``, in member order, on the ``step``."""
        cost = self.member_cost(team)
        if kind == "flops":
            if step == "amortised":
                return tuple(cost.member_flops_of(member) for member in range(team))
            return tuple(cost.step_flops_of(member, step == "peak") for member in range(team))
        if kind == "numel":
            return (float(cost.numel),) * team
        raise ValueError(f"cost must be one of {COST_KINDS}, got {kind!r}")


def matrix_spec(
    name: str,
    shape: Sequence[int],
    rule: MatrixRule,
    bucket: str | None = None,
    holders: Sequence[int] = (),
    dtype: torch.dtype = torch.float32,
) -> MatrixSpec:
    """The spec of a matrix of ``shape`` and ``dtype`` updated by ``rule`` (a convolution: its
    `matrix_shape`'s cost, no teams)."""
    shape = tuple(int(size) for size in shape)
    teams = tuple(rule.team_cost(shape, size) for size in TEAM_SIZES) if len(shape) <= 3 else ()
    return MatrixSpec(
        name,
        shape,
        block_of(name) if bucket is None else bucket,
        rule.cost(matrix_shape(shape)),
        tuple(holders),
        teams,
        dtype.itemsize,
        dtype.itemsize if rule.prepares_copies else 0,
        rule.exchange_dtype(dtype).itemsize,
        rule.batches_matrices,
    )


def block_of(name: str) -> str:
    """A parameter's bucket: its block (``layers.3`` of ``layers.3.mlp.up.weight``), else its module."""
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


# Teams: ranks that compute one matrix's update together, aligned blocks of consecutive ranks
# (docs/architecture.md#planning, "Teams"; how a team slices a matrix is `lightning_canzona.geometry`'s).


#: The team sizes the planner considers (powers of two, so that aligned blocks nest).
TEAM_SIZES: tuple[int, ...] = (2, 4, 8, 16, 32, 64)


@functools.cache
def candidate_teams(num_ranks: int, size: int) -> tuple[tuple[int, ...], ...]:
    """The aligned blocks of ``size`` consecutive ranks among ``num_ranks``."""
    return tuple(tuple(range(start, start + size)) for start in range(0, num_ranks - size + 1, size))


def local_members(
    team: tuple[int, ...], member_loads: Sequence[Hashable], held: Sequence[Sequence[int]]
) -> tuple[int, ...]:
    """``team``'s ranks reordered so that members of alike ``member_loads`` compute where their
    slices lie; ``held[m][p]``: the elements of member ``m``'s slice that ``team[p]`` holds."""
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
