"""Owner assignment: which rank updates which matrix, for every policy but ``sync``.

All functions are pure and deterministic: ties go to the lower index, so every rank computes the
same assignment from the same inputs without talking to the others.
"""

from __future__ import annotations

from collections.abc import Sequence


def round_robin(loads: Sequence[float], num_ranks: int) -> list[int]:
    """Owner ``i mod R`` in model order: the layer-wise baseline, blind to cost."""
    return [index % num_ranks for index in range(len(loads))]


def longest_processing_time(loads: Sequence[float], num_ranks: int) -> list[int]:
    """Largest load first onto the least-loaded rank (Graham's LPT, within 4/3 of optimal)."""
    owners = [0] * len(loads)
    rank_loads = [0.0] * num_ranks
    for index in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        rank = min(range(num_ranks), key=lambda r: (rank_loads[r], r))
        owners[index] = rank
        rank_loads[rank] += loads[index]
    return owners
