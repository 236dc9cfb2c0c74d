"""Swaps that finish a packed plan (`refine`): a lower makespan first, then less optimizer state
per rank, moving only matrices that one rank computes alone and raising no micro-group's or
bucket's busiest load. docs/architecture.md#planning ("Refine") gives the order and the limits."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

from lightning_canzona.planning.plan import Plan

#: Partner ranks tried per swap: the least loaded (makespan) or least stateful (state).
CANDIDATES = 8

#: A bound that a swap keeps: per-rank totals, each matrix's value in them, and the bound.
Limit = tuple[Sequence[float], Sequence[float], float]


def refine(plan: Plan) -> Plan:
    """``plan`` with its single-owner matrices swapped between ranks."""
    if plan.teams is None:
        return plan
    refined = _swapped(plan, periodic=False)
    if plan.period > 1:
        # Either can end shorter on average: lowering the steady and peak loads first, or the
        # state swaps, free to raise either within the makespan (ties: the latter).
        refined = min(refined, _swapped(plan, periodic=True), key=lambda p: p.average_makespan())
    return refined


def _swapped(plan: Plan, periodic: bool) -> Plan:
    """``plan`` after the makespan's swaps, the steady and peak loads' (if ``periodic``), the state's."""
    swaps = _Swaps(plan)
    swaps.lower(swaps.rank_loads, swaps.cost, limits=())
    makespan: Limit = (swaps.rank_loads, swaps.cost, max(swaps.rank_loads))
    limits = [makespan]
    if periodic:
        steady = (swaps.rank_steady, swaps.steady)
        peaks = (swaps.rank_peaks, swaps.peak)
        for lowered, kept in ((steady, peaks), (peaks, steady)):
            swaps.lower(*lowered, [makespan, (*kept, max(kept[0]))])
        limits += [(*steady, max(steady[0])), (*peaks, max(peaks[0]))]
    swaps.lower(swaps.rank_states, swaps.state_bytes, limits)
    teams = tuple(swaps.teams)
    if teams == plan.teams:
        return plan
    return replace(plan, owners=tuple(team[0] for team in teams), teams=teams)


class _Swaps:
    """The per-rank and per-micro-group sums that a swap must keep within bounds."""

    def __init__(self, plan: Plan) -> None:
        ranks = plan.num_ranks
        assert plan.teams is not None
        self.teams = list(plan.teams)
        matrices = plan.matrices
        self.loads = plan.loads
        self.cost = [loads[0] for loads in plan.loads]  # what a matrix that one rank computes costs
        self.steady = [loads[0] for loads in plan.steady]
        self.peak = [loads[0] for loads in plan.peaks]
        self.step_loads = (plan.steady, plan.peaks)
        self.state_bytes = [m.member_cost(len(t)).matrix_state_bytes for m, t in zip(matrices, self.teams)]
        self.received = [m.cost.numel / len(t) for m, t in zip(matrices, self.teams)]
        locality = plan.settings.locality
        self.allowed = [set(m.holders) if locality and m.holders else None for m in matrices]
        self.group = [0] * len(matrices)
        for g, members in enumerate(plan.micro_groups):
            for index in members:
                self.group[index] = g
        self.rank_loads = [0.0] * ranks
        self.rank_steady = [0.0] * ranks
        self.rank_peaks = [0.0] * ranks
        self.rank_states = [0.0] * ranks
        self.items: list[list[int]] = [[] for _ in range(ranks)]
        self.group_loads = [[0.0] * ranks for _ in plan.micro_groups]
        self.group_received = [[0.0] * ranks for _ in plan.micro_groups]
        # As the packer counts them: a matrix updated where it lies is in no bucket's collectives.
        self.bucket = [None if m.holders and locality else m.bucket for m in matrices]
        self.bucket_loads = {bucket: [0.0] * ranks for bucket in self.bucket if bucket is not None}
        # Matrices alike in everything a swap weighs swap alike: only the first of a kind is tried
        # (a mixture of experts' 128 experts per stack and layer on 16 ranks: 780 matrices a rank).
        self.kind = [
            (self.cost[i], self.steady[i], self.peak[i], self.state_bytes[i], self.received[i])
            + (self.group[i], self.bucket[i], None if self.allowed[i] is None else frozenset(self.allowed[i]))
            for i in range(len(matrices))
        ]
        for index, team in enumerate(self.teams):
            for member, rank in enumerate(team):
                self._add(index, rank, 1, member)
        self.group_load_limit = [max(loads) for loads in self.group_loads]
        self.group_received_limit = [max(received) for received in self.group_received]
        self.bucket_limit = {bucket: max(loads) for bucket, loads in self.bucket_loads.items()}

    def _add(self, index: int, rank: int, sign: int, member: int = 0) -> None:
        g, load = self.group[index], sign * self.loads[index][member]
        self.rank_loads[rank] += load
        self.rank_steady[rank] += sign * self.step_loads[0][index][member]
        self.rank_peaks[rank] += sign * self.step_loads[1][index][member]
        self.rank_states[rank] += sign * self.state_bytes[index]
        self.group_loads[g][rank] += load
        self.group_received[g][rank] += sign * self.received[index]
        if self.bucket[index] is not None:
            self.bucket_loads[self.bucket[index]][rank] += load
        if sign > 0:
            self.items[rank].append(index)
        else:
            self.items[rank].remove(index)

    def _move(self, index: int, source: int, target: int) -> None:
        self._add(index, source, -1)
        self._add(index, target, 1)
        self.teams[index] = (target,)

    def _fits(self, index: int, rank: int, leaving: int | None) -> bool:
        """Whether matrix ``index`` may join ``rank``'s part of its group as ``leaving`` leaves."""
        if self.allowed[index] is not None and rank not in self.allowed[index]:
            return False
        g, bucket = self.group[index], self.bucket[index]
        load, received, bucket_load = self.cost[index], self.received[index], self.cost[index]
        if leaving is not None and self.group[leaving] == g:
            load, received = load - self.cost[leaving], received - self.received[leaving]
        if leaving is not None and self.bucket[leaving] == bucket:
            bucket_load -= self.cost[leaving]
        return (
            self.group_loads[g][rank] + load <= self.group_load_limit[g]
            and self.group_received[g][rank] + received <= self.group_received_limit[g]
            and (bucket is None or self.bucket_loads[bucket][rank] + bucket_load <= self.bucket_limit[bucket])
        )

    def lower(self, totals: list[float], values: Sequence[float], limits: Sequence[Limit]) -> None:
        """Swap while the top of ``totals`` can shed ``values`` to another rank within ``limits``."""
        for _ in range(len(self.teams)):  # each swap lowers the sorted totals: this bounds it loosely
            top = max(range(len(totals)), key=lambda r: (totals[r], -r))
            others = [r for r in range(len(totals)) if r != top]
            # The least loaded, and the least loaded with room under every limit (the least
            # loaded may be full in another).
            roomy = [r for r in others if all(limited[r] < bound for limited, _, bound in limits)]
            partners = dict.fromkeys(
                rank
                for ranks in (others, roomy)
                for rank in heapq.nsmallest(CANDIDATES, ranks, key=lambda r: (totals[r], r))
            )
            best = None
            for given in self._single(top):
                for partner in partners:
                    for taken in (None, *self._single(partner)):
                        outcome = self._outcome(totals, values, top, given, partner, taken, limits)
                        if outcome is not None and (best is None or outcome < best[0]):
                            best = (outcome, given, partner, taken)
            if best is None:
                return
            _, given, partner, taken = best
            self._move(given, top, partner)
            if taken is not None:
                self._move(taken, partner, top)

    def _single(self, rank: int) -> list[int]:
        """The matrices that ``rank`` computes alone, the first of each kind (the rest swap alike)."""
        firsts: dict[tuple, int] = {}
        for index in self.items[rank]:
            if len(self.teams[index]) == 1:
                firsts.setdefault(self.kind[index], index)
        return list(firsts.values())

    def _outcome(
        self,
        totals: Sequence[float],
        values: Sequence[float],
        top: int,
        given: int,
        partner: int,
        taken: int | None,
        limits: Sequence[Limit],
    ) -> float | None:
        """The larger of the two ranks' new totals if the swap is allowed and lowers the top."""

        def after(totals: Sequence[float], values: Sequence[float]) -> float:
            back = values[taken] if taken is not None else 0.0
            return max(totals[top] - values[given] + back, totals[partner] - back + values[given])

        if taken is not None and values[taken] >= values[given]:
            return None
        outcome = after(totals, values)
        if outcome >= totals[top]:
            return None
        if any(after(limited, limited_values) > bound for limited, limited_values, bound in limits):
            return None
        if not self._fits(given, partner, taken):
            return None
        if taken is not None and not self._fits(taken, top, given):
            return None
        return outcome
