"""Lower bounds on the makespan: of plans (`team_bound`, `average_bound`), of team sizes (`packing_bound`)."""

from __future__ import annotations

import math

from lightning_canzona.planning.matrices import MatrixSpec, Step
from lightning_canzona.planning.plan import PlanSettings, averaged_over_period, member_loads, shortest_period

#: Classes of matrices as the team search sees them: ``(count, team size, member loads)``.
Classes = list[tuple[int, int, tuple[float, ...]]]


def total_load(classes: Classes) -> float:
    """The total load of classes of ``(count, team size, member loads)``."""
    return sum(n * sum(loads) for n, _, loads in classes)


def team_classes(
    matrices: list[MatrixSpec],
    num_ranks: int,
    settings: PlanSettings,
    busiest: bool = False,
    step: Step = "amortised",
) -> tuple[list[list[int]], list[list[int]], list[dict[int, tuple[float, ...]]]]:
    """Matrices of equal cost as classes: indices, team sizes, member loads by size (``busiest``: max)."""
    classes: dict[tuple, list[int]] = {}
    for index, matrix in enumerate(matrices):
        key = (matrix.cost, matrix.team_costs, bool(matrix.holders))
        classes.setdefault(key, []).append(index)
    members = list(classes.values())
    options = [
        [1]
        if matrices[group[0]].holders
        else [1, *(s for s in matrices[group[0]].team_sizes() if s <= min(settings.max_team, num_ranks))]
        for group in members
    ]
    loads = [
        {size: member_loads(matrices[group[0]], size, settings, step) for size in sizes}
        for group, sizes in zip(members, options)
    ]
    if busiest:
        loads = [{size: (max(load),) * size for size, load in by_size.items()} for by_size in loads]
    return members, options, loads


def team_bound(
    matrices: list[MatrixSpec], num_ranks: int, settings: PlanSettings, step: Step = "amortised"
) -> float:
    """A lower bound on the ``step``'s makespan of every plan with teams of at most ``max_team`` ranks."""
    classes = list(zip(*team_classes(matrices, num_ranks, settings, step=step)))
    best = math.inf
    for limit in sorted({max(load) for _, _, loads in classes for load in loads.values()}):
        total = 0.0
        for group, _, loads in classes:
            allowed = [size for size, load in loads.items() if max(load) <= limit]
            if not allowed:
                break
            total += len(group) * min(sum(loads[size]) for size in allowed)
        else:
            best = min(best, max(limit, total / num_ranks))
    return 0.0 if best == math.inf else best


def average_bound(matrices: list[MatrixSpec], num_ranks: int, settings: PlanSettings) -> float:
    """A lower bound on `Plan.average_makespan`: `team_bound` of steady and peak steps, averaged."""
    period = shortest_period(matrices)
    if period == 1:
        return team_bound(matrices, num_ranks, settings)
    steady, peak = (team_bound(matrices, num_ranks, settings, step) for step in ("steady", "peak"))
    return averaged_over_period(steady, peak, period)


def packing_bound(classes: Classes, num_ranks: int, pairs: bool = True) -> float:
    """The largest of the mean load, the largest member load, each class's ``⌈count · size / ranks⌉``
    least member loads on one rank and (if ``pairs``) `pair_bound`."""
    largest = max((max(loads) for _, _, loads in classes), default=0.0)
    packed = max((math.ceil(n * k / num_ranks) * min(loads) for n, k, loads in classes), default=0.0)
    pair = pair_bound(classes, num_ranks) if pairs else 0.0
    return max(total_load(classes) / num_ranks, largest, packed, pair)


def pair_bound(classes: Classes, num_ranks: int) -> float:
    """``L[ranks] + L[ranks + 1]``, the ``ranks``-th and next largest member loads (0 if fewer)."""
    pair, seen = [], 0
    for n, load in sorted(((n, load) for n, _, loads in classes for load in loads), key=lambda c: -c[1]):
        seen += n
        while len(pair) < 2 and seen >= num_ranks + len(pair):
            pair.append(load)
    return sum(pair) if len(pair) == 2 else 0.0
