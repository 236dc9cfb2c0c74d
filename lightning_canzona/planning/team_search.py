"""How many ranks compute each matrix: the team sizes that `policies.build_plan` plans.

Matrices of the same cost form a class (`bounds.team_classes`). `team_sizes` splits classes
greedily by the packing bound, `overflow_sizes` only what does not fit one to a rank, and
`searched_sizes` packs combinations of sizes (`greedy_makespan`) and moves matrices between sizes.
"""

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
    """How many ranks compute each matrix (see the module docstring).

    Teams trade a larger total (their collectives) for smaller items. Matrices of the same cost
    form a class, split alike. Greedily, the class and team size that lower `packing_bound` (with
    its pair bound if ``pairs``) the most are taken, while one lowers it (or keeps it at no cost:
    free collectives). A matrix that some ranks hold whole stays whole: updated where it lies, it
    moves nothing.
    """
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
    """Team sizes that split only what does not fit one to a rank: candidates beside `team_sizes`.

    Each class starts at its smallest team size whose member load is within the ideal (its
    least load if none is). Where those leave more members costing over half the ideal than
    there are ranks, two of them share a rank however the rest is packed. `team_sizes` splits a
    class alike, every matrix of it paying its team's collectives; it suffices to split the
    overflow. For each such class and each larger size whose members cost at most half the
    ideal, as many of its matrices as free the overflow (evenly spaced in model order, so that
    blocks keep their share) go to teams of that size.
    """
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
    """Team sizes found by packing them (`greedy_makespan`): candidates beside `team_sizes`.

    `packing_bound` cannot see that ranks holding an item above half the makespan have room for
    few others (Qwen3 14B with Muon at 512 ranks: a bound of 1.40 × the ideal for sizes that pack
    at 1.68). First, one size per class: combinations in the order of their packing bound, each
    packed, until the bound reaches the best makespan found (no later one packs shorter) or
    `SEARCH_LIMIT` were packed (`team_sizes`' choice where there are more than
    `SEARCH_COMBINATIONS`). Then, from the best, some matrices of a class move to the next
    larger or smaller size (1, 2, 4, … of them at a time) while a move shortens the packed
    makespan (or keeps it for less total load). The moved matrices are spread evenly over the
    class in model order, as `overflow_sizes` spreads them.

    Where a team's members cost differently (one carries a decomposition), the greedy packing
    puts each member on any of the least loaded ranks, but the packer gives a team an aligned
    block, every rank of which takes a member: the greedy then misjudges sizes whose light
    members must share blocks with busy ranks (Qwen3 32B with Shampoo at 1,024 ranks: 1.25 ×
    the ideal packed greedily, 1.69 by the packer). With ``busiest``, every member is priced as
    the busiest, as if each carried the decomposition: sizes that blocks pack as judged.
    """
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
    """Each matrix's team size, with ``counts[c][size]`` of class ``c``'s matrices at ``size``,
    the sizes interleaved evenly over the class in model order: each matrix takes the size whose
    share of the class so far is furthest behind (the smaller on a tie)."""
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
    """The makespan of classes of ``(count, team size, member loads)`` packed busiest member
    first, each item on the ``size`` least loaded ranks, its busier members on the less loaded:
    the packer's (`balanced_groups`), less its alignment of teams and its micro-groups, in
    ``O(n log ranks)``."""
    ranks = [0.0] * num_ranks
    for count, size, loads in sorted(classes, key=lambda c: -max(c[2])):
        heaviest_first = sorted(loads, reverse=True)
        for _ in range(count):
            team = [heapq.heappop(ranks) for _ in range(size)]  # least loaded first
            for total, load in zip(team, heaviest_first):
                heapq.heappush(ranks, total + load)
    return max(ranks)
