"""Micro-groups: batches of matrices that share one packed gather and one packed scatter.

A micro-group's step takes as long as its busiest host, so the pipeline's latency is the
*synchronized makespan* ``Σ_g max_h load(g, h)``. Two schedulers:

- `sequential_groups` keeps given owners and cuts the model-order sequence into groups: a group
  closes when the next matrix would push a host past the capacity (greedy rollback). It serves the
  baselines.
- `balanced_groups` is Canzona's: it chooses owners and groups together. Matrices are visited
  largest first (LPT); each goes to the host that scores lowest on
  ``α·load_h + (1 − α)·R·bucket_load_h`` — α = 1 balances the ranks' total loads, α = 0 spreads
  every bucket (FSDP unit) evenly so that its collectives are uniform — and into the earliest group
  where that host still has room (first-fit decreasing); when none has, a new group opens.
  Locality goes beyond the paper, which assumes every matrix is fragmented over all ranks: a
  matrix that some ranks hold whole (experts that FSDP2 splits on the expert dimension) chooses
  among those ranks only, by the same score, so that its update moves no bytes. Those matrices
  are placed first; the fragmented ones, free to go anywhere, then even out the loads of the
  groups of ranks that hold matrices together (a data-parallel row of experts); last, with the
  fragmented ones kept where they went, the held ones are placed again, so that within a group
  the ranks that took a large fragmented matrix take fewer held ones. Held matrices count in the
  ranks' loads but not in their buckets': the bucket term evens out collectives, in which a
  matrix updated where it lies takes no part (counted, it pushed 30B-A3B's attention matrices
  away from the ranks of their layer's experts whatever their loads: 1.054 × the bound at
  dp 32 × tp 8 instead of 1.008).

A matrix that a team of ranks computes together (`teams`) goes to the aligned block of ranks
whose busiest member scores lowest, into the first group where every member has room, and adds
each member's cost to its rank. Where members cost differently (one carries a factor's
decomposition), the busier members go to the block's less loaded ranks: the team's ranks are
then listed in member order, not in rank order.

In both, a matrix costlier than the capacity on its own forms its own group. A group's average
host load never exceeds its largest, so bounding the largest bounds both.
"""

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
    """Canzona's joint choice of owners and micro-groups (see the module docstring).

    Args:
        loads: Cost of each matrix to each rank that computes it, in member order: one load for
            a matrix that one rank computes, one per member for a team's.
        buckets: Bucket of each matrix.
        num_ranks: Number of hosts ``R``.
        alpha: Balance between per-bucket uniformity (0) and global balance (1).
        capacity: Largest load a host may take within one group.
        holders: For each matrix, the ranks that hold it whole (empty: any rank); ``None``
            ignores locality.

    Returns:
        The groups (matrix indices in model order within each group) and the ranks that compute
        each matrix, in member order (its owner alone, or its team).
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
    """Visit the matrices in ``order``, each to its ``fixed`` ranks or to the best-scoring of its
    candidates (its holders, every rank, or every aligned team), into the first group with room."""
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
        """The candidate of the least ``α·load + (1 − α)·R·bucket load``. Ties (always, at
        α = 0, between ranks without a share of this bucket) go to the rank with the least total
        load, then the least loaded group, then the lowest rank."""
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
    """The block of ``blocks`` whose busiest rank, with a team of member loads ``load`` on it
    (its busier members on the block's less loaded ranks: no other order is less busy), is the
    least busy; the first on a tie. ``maxima`` and ``minima`` are the blocks' largest and least
    rank loads.

    Members that cost alike: the block of the least maximum. Otherwise a block's busiest rank is
    at least its most loaded rank plus the lightest member, and its least loaded rank plus the
    heaviest member (one that decomposes), so the blocks are tried in the order of that bound
    until it exceeds the best found: one sort of the blocks, not a sort of each block's loads.
    """
    heaviest_first = sorted(load, reverse=True)
    if heaviest_first[0] == heaviest_first[-1]:
        return blocks[min(range(len(blocks)), key=maxima.__getitem__)]
    heaviest, lightest, best = heaviest_first[0], heaviest_first[-1], (math.inf, 0)
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
    """The ranks of ``block`` in member order: the busier members on the less loaded ranks where
    that lowers the busiest rank, else in rank order."""
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
