"""How many ranks compute each matrix: the candidate team sizes that `policies.build_plan` plans
(docs/architecture.md#planning, "Teams")."""

from __future__ import annotations

import heapq
import itertools
import math

from lightning_canzona.planning.bounds import Classes, packing_bound, team_classes, total_load
from lightning_canzona.planning.matrices import MatrixSpec
from lightning_canzona.planning.plan import PlanSettings, ideal_load

#: Most combinations of team sizes, one per class, that `searched_sizes` lists (beyond, it starts
#: from `team_sizes`' choice).
SEARCH_COMBINATIONS = 4096
#: Most combinations that `searched_sizes` packs (in the order of their bound), and most moves.
SEARCH_LIMIT = 64


def team_sizes(
    matrices: list[MatrixSpec], num_ranks: int, settings: PlanSettings, pairs: bool = True
) -> list[int]:
    """Team sizes that greedily lower `packing_bound` (with its pair bound if ``pairs``), class by
    class; a matrix that some ranks hold whole stays whole."""
    members, options, loads = team_classes(matrices, num_ranks, settings)
    chosen = [1] * len(members)

    def bound(sizes: list[int]) -> tuple[float, float]:
        """The packing bound and the total load with each class split in ``sizes``."""
        split = [(len(group), size, load[size]) for group, size, load in zip(members, sizes, loads)]
        return packing_bound(split, num_ranks, pairs), total_load(split)

    current, total = bound(chosen)
    while True:
        trials = [
            (bound([*chosen[:c], size, *chosen[c + 1 :]]), c, size)
            for c in range(len(members))
            for size in options[c]
            if size > chosen[c]
        ]
        best = min(trials, default=None)
        if best is None or not (best[0][0] < current or (best[0][0] == current and best[0][1] <= total)):
            break
        (current, total), c, size = best
        chosen[c] = size
    sizes = [1] * len(matrices)
    for group, size in zip(members, chosen):
        for index in group:
            sizes[index] = size
    return sizes


def overflow_sizes(matrices: list[MatrixSpec], num_ranks: int, settings: PlanSettings) -> list[list[int]]:
    """Team sizes that split only what does not fit one to a rank: candidates beside `team_sizes`."""
    members, options, loads = team_classes(matrices, num_ranks, settings)
    ideal = ideal_load(matrices, num_ranks, settings.cost)
    busiest = [{size: max(load) for size, load in load.items()} for load in loads]
    base = [
        next((k for k in sizes if load[k] <= ideal), min(sizes, key=load.__getitem__))
        for sizes, load in zip(options, busiest)
    ]
    base_sizes = [1] * len(matrices)
    for group, size in zip(members, base):
        for index in group:
            base_sizes[index] = size
    large = [c for c, load in enumerate(busiest) if load[base[c]] > ideal / 2]
    overflow = sum(len(members[c]) * base[c] for c in large) - num_ranks
    candidates = []
    for c in large:
        group, moves = members[c], -(-overflow // base[c])  # each frees its base-size members
        if not 0 < moves <= len(group):
            continue
        moved = [group[i * len(group) // moves] for i in range(moves)]
        for size in (k for k in options[c] if k > base[c] and busiest[c][k] <= ideal / 2):
            sizes = list(base_sizes)
            for index in moved:
                sizes[index] = size
            candidates.append(sizes)
    return candidates


def searched_sizes(
    matrices: list[MatrixSpec], num_ranks: int, settings: PlanSettings, busiest: bool = False
) -> list[list[int]]:
    """Team sizes found by packing them (`greedy_makespan`): the best one size per class, then the
    best after moving matrices between sizes. With ``busiest``, every member priced as the busiest."""
    members, options, loads = team_classes(matrices, num_ranks, settings, busiest)

    def packed(counts: list[dict[int, int]]) -> tuple[float, float]:
        classes = [(n, k, load[k]) for sizes, load in zip(counts, loads) for k, n in sizes.items() if n]
        return greedy_makespan(classes, num_ranks), total_load(classes)

    if math.prod(map(len, options)) > SEARCH_COMBINATIONS:  # too many to list: start from the greedy's
        chosen = team_sizes(matrices, num_ranks, settings)
        counts = [{chosen[group[0]]: len(group)} for group in members]
        best = (packed(counts), counts)
    else:
        combinations = []
        for combination in itertools.product(*options):
            classes = [
                (len(group), size, load[size]) for group, size, load in zip(members, combination, loads)
            ]
            combinations.append((packing_bound(classes, num_ranks), combination))
        combinations.sort()
        best = None
        for bound, combination in combinations[:SEARCH_LIMIT]:
            if best is not None and bound >= best[0][0]:
                break
            counts = [{size: len(group)} for group, size in zip(members, combination)]
            trial = (packed(counts), counts)
            best = trial if best is None or trial[0] < best[0] else best
        assert best is not None
    uniform = best[1]
    for _ in range(SEARCH_LIMIT):  # each move shortens the packing: a cap for time, not for cycles
        moves = []
        for c, sizes in enumerate(best[1]):
            for source, count in sizes.items():
                at = options[c].index(source)
                for target in options[c][max(at - 1, 0) : at + 2]:
                    if target == source:
                        continue
                    for moved in sorted({*(1 << p for p in range(count.bit_length())), count} - {0}):
                        counts = [dict(s) for s in best[1]]
                        counts[c][source] -= moved
                        counts[c][target] = counts[c].get(target, 0) + moved
                        moves.append((packed(counts), counts))
        better = min(moves, key=lambda move: move[0], default=None)
        if better is None or not better[0] < best[0]:
            break
        best = better
    return [sizes_of(members, counts, len(matrices)) for counts in (uniform, best[1])]


def sizes_of(members: list[list[int]], counts: list[dict[int, int]], num_matrices: int) -> list[int]:
    """Each matrix's team size: ``counts[c][size]`` of class ``c`` at ``size``, spread evenly."""
    sizes = [1] * num_matrices
    for group, by_size in zip(members, counts):
        taken = dict.fromkeys(by_size, 0)
        for position, index in enumerate(group):
            size = max(
                (size for size, n in by_size.items() if taken[size] < n),
                key=lambda size: (by_size[size] * (position + 1) / len(group) - taken[size], -size),
            )
            taken[size] += 1
            sizes[index] = size
    return sizes


def greedy_makespan(classes: Classes, num_ranks: int) -> float:
    """The makespan of classes packed busiest first onto the least loaded ranks (no aligned blocks)."""
    ranks = [0.0] * num_ranks
    for count, size, loads in sorted(classes, key=lambda c: -max(c[2])):
        heaviest_first = sorted(loads, reverse=True)
        for _ in range(count):
            team = [heapq.heappop(ranks) for _ in range(size)]  # least loaded first
            for total, load in zip(team, heaviest_first):
                heapq.heappush(ranks, total + load)
    return max(ranks)
