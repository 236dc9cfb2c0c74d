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
  among those ranks only, by the same score, so that its update moves no bytes; the matrices
  that come later in the LPT order balance the loads around it.

In both, a matrix costlier than the capacity on its own forms its own group. A group's average
host load never exceeds its largest, so bounding the largest bounds both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
    loads: Sequence[float],
    buckets: Sequence[str],
    num_ranks: int,
    alpha: float,
    capacity: float,
    holders: Sequence[Sequence[int]] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Canzona's joint choice of owners and micro-groups (see the module docstring).

    Args:
        loads: Cost of each matrix.
        buckets: Bucket of each matrix.
        num_ranks: Number of hosts ``R``.
        alpha: Balance between per-bucket uniformity (0) and global balance (1).
        capacity: Largest load a host may take within one group.
        holders: For each matrix, the ranks that hold it whole (empty: any rank); ``None``
            ignores locality.

    Returns:
        The groups (matrix indices in model order within each group) and every matrix's owner.
    """
    _check_capacity(capacity)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    rank_loads = [0.0] * num_ranks
    bucket_loads: dict[str, list[float]] = {}
    group_loads: list[list[float]] = []
    members: list[list[int]] = []
    owners = [0] * len(loads)

    def score(rank: int, bucket: str) -> tuple[float, float, int]:
        spread = bucket_loads.setdefault(bucket, [0.0] * num_ranks)[rank]
        # Ties (always, at α = 0, between ranks without a share of this bucket) go to the rank
        # with the least total load, then to the lowest rank.
        return alpha * rank_loads[rank] + (1.0 - alpha) * num_ranks * spread, rank_loads[rank], rank

    for index in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        load, bucket = loads[index], buckets[index]
        candidates = (holders[index] if holders else ()) or range(num_ranks)
        rank = min(candidates, key=lambda r: score(r, bucket))
        group = next((g for g, hosts in enumerate(group_loads) if hosts[rank] + load <= capacity), None)
        if group is None:
            group = len(group_loads)
            group_loads.append([0.0] * num_ranks)
            members.append([])
        owners[index] = rank
        members[group].append(index)
        group_loads[group][rank] += load
        if load > capacity:  # an oversize matrix keeps its group to itself
            group_loads[group] = [math.inf] * num_ranks
        rank_loads[rank] += load
        bucket_loads[bucket][rank] += load
    return [sorted(group) for group in members], owners


def _check_capacity(capacity: float) -> None:
    if not capacity > 0:
        raise ValueError(f"micro-group capacity must be > 0, got {capacity}")
