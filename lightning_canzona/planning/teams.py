"""Teams: ranks that compute one matrix's update together (beyond the paper).

Whole-matrix ownership stops scaling where one matrix's update costs more than a rank's fair share
of the step: the step can then never be shorter than that matrix alone. A rule whose update
splits exactly (`MatrixRule.team_cost`) lets a *team* of ``k`` ranks compute it: each member
holds one slice of the matrix along its long dimension (`geometry.member_blocks`) and the members combine
small partial results through collectives among themselves.

Teams are aligned blocks of consecutive ranks (`candidate_teams`): few distinct teams, so few
process groups, and on a ``dp × tp`` mesh whose ``tp`` ranks share a node a team of up to ``tp``
ranks stays within the node. How a team slices a matrix is `lightning_canzona.geometry`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence

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
