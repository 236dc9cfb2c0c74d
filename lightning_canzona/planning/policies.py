"""Building plans (`build_plan`): who updates which matrix, in which micro-group, under each policy.

Policies ``sync``, ``round_robin``, ``lpt`` and ``canzona`` (docs/architecture.md#planning). A
plan is a pure function of its inputs: every rank builds the same one alone."""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from lightning_canzona.planning.bounds import team_classes
from lightning_canzona.planning.matrices import MatrixSpec
from lightning_canzona.planning.memory import nearest_fit, shrink_limits, split_groups
from lightning_canzona.planning.micro_groups import balanced_groups, sequential_groups
from lightning_canzona.planning.plan import Plan, PlanSettings, estimated_step, member_loads
from lightning_canzona.planning.refine import refine
from lightning_canzona.planning.team_search import overflow_sizes, searched_sizes, team_sizes

#: Teams cost more than their loads say (members wait for each other; smaller items make more
#: micro-groups, each with a gather and a scatter): a plan with teams is kept only if its makespan
#: or its estimated step is at most this fraction of the whole matrices' plan's (unless
#: collectives are priced at zero), and its estimated step no longer.
TEAM_GAIN = 0.95

#: Plans whose estimated steps differ by less than this fraction are alike to the planner (an
#: estimate: `estimated_step`); among them, the better balanced is kept.
STEP_TOLERANCE = 0.02

#: Per-rank optimizer state within this factor of the mean counts as balanced: among plans alike
#: in speed (`STEP_TOLERANCE`), those that balance it are preferred.
STATE_BALANCE = 1.1

#: Most rounds of `build_plan`'s descent over team sizes set class by class (`_descend`).
DESCENT_ROUNDS = 4

#: The default memory budget ("auto") cuts micro-groups only while the estimated step grows by at
#: most this fraction: where collectives are dear beside the compute (small models), speed binds.
MEMORY_STEP_TOLERANCE = 0.05

#: The default capacity leaves about this many micro-groups per rank, so that gathers and
#: scatters of neighbouring groups can hide behind compute.
GROUPS_PER_RANK = 2


def _capacity(settings: PlanSettings, loads: list[float], per_rank: float) -> float:
    largest = max(loads, default=0.0)
    if settings.capacity is not None:
        return settings.capacity
    # More groups overlap more, but each costs a gather and a scatter: a rank's share is cut into
    # GROUPS_PER_RANK only where each group's compute outlasts its two collectives' latency.
    groups = GROUPS_PER_RANK
    if settings.cost == "flops" and per_rank < GROUPS_PER_RANK * 2 * settings.flops_per_message:
        groups = 1
    # A quarter of slack lets first-fit packing fit each rank's share into that many groups
    # instead of spilling a sliver into one more group (and two more collectives).
    return max(largest, 1.25 * per_rank / groups, 1e-30)


def _fixed_owner_plan(settings, matrices, dp, tp, owners, capacity, fell_back=False) -> Plan:
    groups = sequential_groups(owners, [m.load(settings.cost) for m in matrices], capacity)
    return Plan(
        settings, tuple(matrices), dp, tp, tuple(owners), tuple(map(tuple, groups)), capacity, fell_back
    )


def team_plan(settings: PlanSettings, matrices: list[MatrixSpec], dp: int, tp: int, sizes: list[int]) -> Plan:
    """canzona's plan with each matrix computed by ``sizes[i]`` ranks."""
    num_ranks = dp * tp
    loads = [member_loads(m, size, settings) for m, size in zip(matrices, sizes)]
    whole_loads = [m.load(settings.cost) for m in matrices]
    buckets = [m.bucket for m in matrices]
    holders = [m.holders for m in matrices] if settings.locality else None
    # Teams' smaller items allow more micro-groups, each waiting for its busiest rank's exchange:
    # both capacities are planned where they differ. Members that cost differently are placed as
    # they cost and as if each cost the busiest's (LPT places each item once: lighter items can
    # pack worse). The shorter estimated step is kept.
    per_rank = sum(whole_loads) / num_ranks
    busiest = [max(load) for load in loads]
    capacities = {_capacity(settings, each, per_rank) for each in (busiest, whole_loads)}
    placements = dict.fromkeys(
        [tuple(loads), tuple((most,) * len(load) for most, load in zip(busiest, loads))]
    )
    plans = []
    for capacity, placed in itertools.product(sorted(capacities), placements):
        groups, teams = balanced_groups(placed, buckets, num_ranks, settings.alpha, capacity, holders)
        owners = tuple(team[0] for team in teams)
        groups_ = tuple(map(tuple, groups))
        plans.append(
            refine(Plan(settings, tuple(matrices), dp, tp, owners, groups_, capacity, teams=tuple(teams)))
        )
    return plans[0] if len(plans) == 1 else min(plans, key=estimated_step)


def _scored(plan: Plan) -> tuple[float, Plan]:
    return estimated_step(plan), plan


def _descend(
    matrices: list[MatrixSpec],
    dp: int,
    tp: int,
    settings: PlanSettings,
    scored: dict[tuple[int, ...], tuple[float, Plan]],
) -> None:
    """Adds to ``scored`` the plans of a descent on the estimated step, one class's size at a time."""
    members, options, _ = team_classes(matrices, dp * tp, settings)

    def step_of(choice: tuple[int, ...]) -> float:
        sizes = [1] * len(matrices)
        for group, size in zip(members, choice):
            for index in group:
                sizes[index] = size
        key = tuple(sizes)
        if key not in scored:
            scored[key] = _scored(team_plan(settings, matrices, dp, tp, sizes))
        return scored[key][0]

    shortest = min(scored, key=lambda sizes: scored[sizes][0])
    current = tuple(collections.Counter(shortest[i] for i in group).most_common(1)[0][0] for group in members)
    current_step = step_of(current)
    for _ in range(DESCENT_ROUNDS):
        changes = [
            (*current[:c], size, *current[c + 1 :]) for c in range(len(members)) for size in options[c]
        ]
        step, choice = min(((step_of(c), c) for c in changes if c != current), default=(math.inf, current))
        if not step < current_step:
            break
        current, current_step = choice, step


def build_plan(matrices: list[MatrixSpec], dp: int, tp: int, settings: PlanSettings | None = None) -> Plan:
    """Plan the updates of ``matrices`` (in model order) on a ``dp × tp`` mesh, its micro-groups cut
    to the memory budget (`fit_memory`)."""
    return fit_memory(_build_plan(matrices, dp, tp, settings or PlanSettings()))


def fit_memory(plan: Plan) -> Plan:
    """``plan`` with its micro-groups cut until every rank's step buffers fit its memory budget, or
    as small as they get (each rank's part of a group one matrix at most). The default budget cuts
    only while the estimated step stays within `MEMORY_STEP_TOLERANCE` of the uncut plan's."""
    target = plan.memory_target()
    # Under sync every rank computes every matrix: its memory is not what a budget could bound.
    if target is None or plan.teams is None or max(memory.peak for memory in plan.rank_memory()) <= target:
        return plan
    budget = plan.settings.memory_budget
    assert budget is not None
    sizes = computed_bytes(plan)
    largest = max(
        (max(_held_by_rank(group, sizes).values(), default=0) for group in plan.micro_groups), default=0
    )
    single = max((max(size.values(), default=0) for size in sizes), default=0)
    candidates = [
        replace(plan, micro_groups=tuple(split_groups(plan.micro_groups, sizes, limit)))
        for limit in shrink_limits(largest, single)
    ]
    if not budget.strict:
        longest = (1 + MEMORY_STEP_TOLERANCE) * estimated_step(plan)
        candidates = [candidate for candidate in candidates if estimated_step(candidate) <= longest]
    if not candidates:
        return plan
    peaks = [max(memory.peak for memory in candidate.rank_memory()) for candidate in candidates]
    return candidates[nearest_fit(peaks, target)]


def computed_bytes(plan: Plan) -> list[dict[int, int]]:
    """Per matrix, rank → bytes of what that rank computes of it (its whole, or a team member's slice)."""
    assert plan.teams is not None
    return [
        {rank: matrix.cost.numel * matrix.exchange_bytes // len(team) for rank in team}
        for matrix, team in zip(plan.matrices, plan.teams)
    ]


def _held_by_rank(group: Sequence[int], sizes: Sequence[dict[int, int]]) -> dict[int, int]:
    totals: dict[int, int] = collections.defaultdict(int)
    for index in group:
        for rank, nbytes in sizes[index].items():
            totals[rank] += nbytes
    return totals


def _build_plan(matrices: list[MatrixSpec], dp: int, tp: int, settings: PlanSettings) -> Plan:
    if dp < 1 or tp < 1:
        raise ValueError(f"mesh sizes must be >= 1, got dp={dp}, tp={tp}")
    num_ranks = dp * tp
    loads = [m.load(settings.cost) for m in matrices]
    if settings.policy == "sync":
        capacity = _capacity(settings, loads, sum(loads))
        groups = sequential_groups([0] * len(matrices), loads, capacity)
        return Plan(settings, tuple(matrices), dp, tp, None, tuple(map(tuple, groups)), capacity)
    capacity = _capacity(settings, loads, sum(loads) / num_ranks)
    if settings.policy == "round_robin":
        return _fixed_owner_plan(settings, matrices, dp, tp, round_robin(loads, num_ranks), capacity)
    if settings.policy == "lpt":
        owners = longest_processing_time(loads, num_ranks)
        return _fixed_owner_plan(settings, matrices, dp, tp, owners, capacity)
    # Candidate team sizes (the greedy's with and without the pair bound, the overflow's splits,
    # the searched sizes, a descent): of the plans within `STEP_TOLERANCE` of the shortest
    # estimated step, one that balances the state, then the shortest makespan on average. By
    # makespan alone, plans whose busiest rank receives more would win.
    candidates = dict.fromkeys(
        [
            *(tuple(team_sizes(matrices, num_ranks, settings, pairs)) for pairs in (True, False)),
            *map(tuple, overflow_sizes(matrices, num_ranks, settings)),
            *(
                tuple(sizes)
                for busiest in (False, True)
                for sizes in searched_sizes(matrices, num_ranks, settings, busiest)
            ),
        ]
    )
    by_sizes = {sizes: _scored(team_plan(settings, matrices, dp, tp, list(sizes))) for sizes in candidates}
    _descend(matrices, dp, tp, settings, by_sizes)
    scored = list(by_sizes.values())
    shortest = min(step for step, _ in scored)
    alike = [(step, plan) for step, plan in scored if step <= (1 + STEP_TOLERANCE) * shortest]
    # Alike in speed, a plan that balances the optimizer state (what sets a rank's memory) first.
    balanced = [(step, plan) for step, plan in alike if plan.state_max_over_mean() <= STATE_BALANCE]
    step, plan = min(balanced or alike, key=lambda scored_plan: scored_plan[1].average_makespan())
    if plan.split_matrices():  # teams must pack better than whole matrices, not only bound better
        whole = _build_plan(matrices, dp, tp, replace(settings, max_team=1))
        free = settings.flops_per_element == settings.flops_per_message == 0
        gain = 1.0 if free else TEAM_GAIN
        packs = plan.average_makespan() <= gain * whole.average_makespan()
        # ...or shorten the step with its gathers and scatters, which teams change too (the
        # busiest rank receives a slice of a matrix, not the whole), and never lengthen it.
        # (Whole, the plan keeps the settings it was asked for: its report's team bound too.)
        whole_step = estimated_step(whole)
        shortens = step <= gain * whole_step
        plan = plan if (packs or shortens) and step <= whole_step else replace(whole, settings=settings)
    naive = _fixed_owner_plan(
        settings, matrices, dp, tp, round_robin(loads, num_ranks), capacity, fell_back=True
    )
    return plan if plan.average_makespan() <= naive.average_makespan() else naive


# Owner assignment of the baselines: pure, ties to the lower index, so every rank agrees.


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
