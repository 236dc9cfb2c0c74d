"""Micro-groups: batches of matrices that share one packed gather and one packed scatter.

`sequential_groups` cuts the baselines' fixed owners in model order; `balanced_groups` is
Canzona's packer, choosing owners (single ranks, holders, or aligned teams) and groups together.
docs/architecture.md#planning ("Canzona", "Experts", "Teams") describes both."""

from __future__ import annotations

import collections
import functools
import math
import operator
from collections.abc import Sequence

from lightning_canzona.planning.matrices import candidate_teams


def sequential_groups(owners: Sequence[int], loads: Sequence[float], capacity: float) -> list[list[int]]:
    """Cut matrices ``0 … n−1`` (model order) with fixed ``owners`` into capacity-bounded groups."""
    _check_capacity(capacity)
    groups: list[list[int]] = []
    current: list[int] = []
    host_loads: dict[int, float] = {}
    for index, (owner, load) in enumerate(zip(owners, loads)):
        if current and (load > capacity or host_loads.get(owner, 0.0) + load > capacity):
            groups.append(current)
            current, host_loads = [], {}
        if load > capacity:
            groups.append([index])
            continue
        current.append(index)
        host_loads[owner] = host_loads.get(owner, 0.0) + load
    if current:
        groups.append(current)
    return groups


def balanced_groups(
    loads: Sequence[Sequence[float]],
    buckets: Sequence[str],
    num_ranks: int,
    alpha: float,
    capacity: float,
    holders: Sequence[Sequence[int]] | None = None,
) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """Canzona's joint choice of owners and micro-groups: the groups (indices in model order) and
    each matrix's ranks in member order.

    Args:
        loads: Each matrix's cost to each rank that computes it (one per team member).
        capacity: Largest load a host may take within one group.
        holders: Per matrix, the ranks that hold it whole (empty: any); ``None`` ignores locality.
    """
    _check_capacity(capacity)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    held = [tuple(h) for h in holders] if holders else [()] * len(loads)
    loads = [tuple(load) for load in loads]
    place = functools.partial(_place, loads, buckets, held, num_ranks, alpha, capacity)
    pinned = sorted((i for i in range(len(loads)) if held[i]), key=lambda i: (-max(loads[i]), i))
    free = sorted((i for i in range(len(loads)) if not held[i]), key=lambda i: (-max(loads[i]), i))
    if not (pinned and free):
        return place(pinned + free, {})
    # The held matrices first, so that the free ones, placed largest first around them, even out
    # the loads of the holder groups; then the held ones again, each group's balanced around the
    # free ones that it took.
    _, first = place(pinned + free, {})
    return place(free + pinned, {i: first[i] for i in free})


def _place(
    loads: Sequence[tuple[float, ...]],
    buckets: Sequence[str],
    held: Sequence[tuple[int, ...]],
    num_ranks: int,
    alpha: float,
    capacity: float,
    order: Sequence[int],
    fixed: dict[int, tuple[int, ...]],
) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """Place the matrices in ``order`` (each to its ``fixed`` ranks or the best-scoring candidate)."""
    rank_loads = [0.0] * num_ranks
    bucket_loads: dict[str, list[float]] = {}
    group_loads: list[list[float]] = []
    members: list[list[int]] = []
    owners: list[tuple[int, ...]] = [(0,)] * len(loads)
    teams = {len(load): candidate_teams(num_ranks, len(load)) for load in loads if len(load) > 1}
    # The largest and the least rank load of each aligned block of each team size (and of the
    # ranks past the last block), updated with the loads of its ranks (`least_busy_block`).
    block_maxima = {size: [0.0] * -(-num_ranks // size) for size in teams}
    block_minima = {size: [0.0] * -(-num_ranks // size) for size in teams}
    # Ranks that hold matrices together (a data-parallel row holding the same experts) share
    # those matrices' load: a free matrix prefers, among equally loaded ranks, the least
    # loaded such group, which can still move its held matrices to even itself out.
    group_of = list(range(num_ranks))
    for holders in held:
        for rank in holders:
            group_of[rank] = min(holders)
    holder_counts = collections.Counter(group_of)
    group_size = [holder_counts[group] for group in group_of]
    group_totals = [0.0] * num_ranks  # by the group's lowest rank

    spread_weight = (1.0 - alpha) * num_ranks

    def best_rank(candidates: Sequence[int], bucket: str) -> int:
        """The candidate of the least ``α·load + (1 − α)·R·bucket load``, then least loaded."""
        spread = bucket_loads[bucket]
        scores = [alpha * rank_loads[rank] + spread_weight * spread[rank] for rank in candidates]
        least = min(scores)
        tied = [rank for rank, score in zip(candidates, scores) if score == least]
        return min(
            tied, key=lambda rank: (rank_loads[rank], group_totals[group_of[rank]] / group_size[rank], rank)
        )

    for index in order:
        load, bucket = loads[index], buckets[index]
        bucket_loads.setdefault(bucket, [0.0] * num_ranks)
        if index in fixed:
            team = fixed[index]
        elif len(load) > 1:
            # A team spreads its bucket's share over its members already: placed by load alone.
            size = len(load)
            block = least_busy_block(teams[size], block_maxima[size], block_minima[size], rank_loads, load)
            team = _members_on(block, load, rank_loads)
        else:
            team = (best_rank(held[index] or range(num_ranks), bucket),)
        group = next(
            (
                g
                for g, hosts in enumerate(group_loads)
                if all(hosts[rank] + member <= capacity for rank, member in zip(team, load))
            ),
            None,
        )
        if group is None:
            group = len(group_loads)
            group_loads.append([0.0] * num_ranks)
            members.append([])
        owners[index] = team
        members[group].append(index)
        for rank, member in zip(team, load):
            group_loads[group][rank] += member
            rank_loads[rank] += member
            for size in teams:
                block = rank // size
                block_loads = rank_loads[block * size : (block + 1) * size]
                block_maxima[size][block], block_minima[size][block] = max(block_loads), min(block_loads)
            group_totals[group_of[rank]] += member
            if not held[index]:  # updated where it lies, it takes no part in its bucket's collectives
                bucket_loads[bucket][rank] += member
        if max(load) > capacity:  # an oversize matrix keeps its group to itself
            group_loads[group] = [math.inf] * num_ranks
    return [sorted(group) for group in members], owners


def least_busy_block(
    blocks: Sequence[tuple[int, ...]],
    maxima: Sequence[float],
    minima: Sequence[float],
    rank_loads: Sequence[float],
    load: Sequence[float],
) -> tuple[int, ...]:
    """The block least busy with a team of member loads ``load`` on it (the first on a tie), given
    the blocks' largest and least rank loads."""
    heaviest_first = sorted(load, reverse=True)
    if heaviest_first[0] == heaviest_first[-1]:
        return blocks[min(range(len(blocks)), key=maxima.__getitem__)]
    heaviest, lightest, best = heaviest_first[0], heaviest_first[-1], (math.inf, 0)
    # A block's busiest rank is at least its most loaded rank plus the lightest member and its
    # least loaded plus the heaviest: blocks are tried in the order of that bound.
    bounds = [max(most + lightest, least + heaviest) for most, least in zip(maxima, minima)]
    for index in sorted(range(len(blocks)), key=bounds.__getitem__):  # stable: ties by index
        if (bounds[index], index) > best:  # neither it nor any after can be less busy, or tie first
            break
        ranks = sorted(rank_loads[rank] for rank in blocks[index])
        best = min(best, (max(map(operator.add, ranks, heaviest_first)), index))
    return blocks[best[1]]


def _members_on(
    block: tuple[int, ...], load: tuple[float, ...], rank_loads: Sequence[float]
) -> tuple[int, ...]:
    """``block`` in member order: busier members on less loaded ranks where that helps."""
    if min(load) == max(load):
        return block
    ranks = sorted(block, key=lambda rank: (rank_loads[rank], rank))
    members = sorted(range(len(load)), key=lambda member: (-load[member], member))
    team = [0] * len(load)
    for member, rank in zip(members, ranks):
        team[member] = rank

    def busiest(order: Sequence[int]) -> float:
        return max(rank_loads[rank] + member for rank, member in zip(order, load))

    return tuple(team) if busiest(team) < busiest(block) else block


def _check_capacity(capacity: float) -> None:
    if not capacity > 0:
        raise ValueError(f"micro-group capacity must be > 0, got {capacity}")
