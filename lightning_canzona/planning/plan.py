"""Plans: who updates which matrix, in which micro-group, under each policy.

Policies:

- ``sync``: every rank updates every matrix (the redundant baseline: ``torch.optim.Muon`` on
  DTensors behaves like this);
- ``round_robin``: owner ``i mod R`` in model order (the layer-wise baseline, blind to cost);
- ``lpt``: largest cost first onto the least-loaded rank, one global pass;
- ``canzona``: owners and micro-groups chosen together, α-balanced between per-bucket uniformity
  and global balance (see `micro_groups.balanced_groups`); kept only if its makespan beats
  round-robin's.

Beyond the paper, ``canzona`` gives the costliest matrices to *teams* of ranks that compute one
update together, where the rule allows (`teams`, `MatrixRule.team_cost`) and the cost model says
it pays (`team_sizes`). Without teams, the step can never be shorter than the largest matrix's
update, and matrices larger than half a rank's share cannot be packed evenly.

The baselines are cut into micro-groups in model order under the same capacity. Under FSDP2 × TP
every matrix is spread over the whole mesh, so any rank can own any matrix and the mesh is planned
as one set of ``dp·tp`` ranks. A plan is a pure function of the matrices, the mesh shape and the
settings: every rank builds the same plan alone.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from lightning_canzona.planning import partition
from lightning_canzona.planning.matrices import COST_KINDS, CostKind, MatrixSpec, Step
from lightning_canzona.planning.micro_groups import balanced_groups, sequential_groups
from lightning_canzona.planning.pipeline import averaged_over_period, pipelined_time
from lightning_canzona.planning.refine import refine
from lightning_canzona.planning.teams import TEAM_SIZES

POLICIES: tuple[str, ...] = ("canzona", "lpt", "round_robin", "sync")

#: Classes of matrices as the team search sees them: ``(count, team size, member loads)``.
Classes = list[tuple[int, int, tuple[float, ...]]]

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

#: Most combinations of team sizes, one per class, that `searched_sizes` lists (beyond, it starts
#: from `team_sizes`' choice).
SEARCH_COMBINATIONS = 4096
#: Most combinations that `searched_sizes` packs (in the order of their bound), and most moves.
SEARCH_LIMIT = 64

#: Most rounds of `build_plan`'s descent over team sizes set class by class (`_descend`).
DESCENT_ROUNDS = 4

#: The default capacity leaves about this many micro-groups per rank, so that gathers and
#: scatters of neighbouring groups can hide behind compute.
GROUPS_PER_RANK = 2


@dataclass(frozen=True)
class PlanSettings:
    """How to plan.

    Attributes:
        policy: One of ``canzona``, ``lpt``, ``round_robin``, ``sync``.
        alpha: ``canzona``'s balance between per-bucket uniformity (0) and global balance (1).
        cost: What to balance: ``flops`` of the updates or ``numel`` of the matrices.
        capacity: Largest host load of a micro-group, in the cost's unit; ``None`` derives it from
            the model: 1.25 × half the mean per-rank load (the whole of it where a group's compute
            could not hide its two collectives' latency, ``flops_per_message``), at least the
            largest matrix.
        locality: ``canzona`` gives a matrix that some ranks hold whole to one of them (see
            `micro_groups.balanced_groups`); ``False`` plans as if every matrix were fragmented.
        max_team: Most ranks that ``canzona`` lets compute one matrix's update together (a power
            of two; 1 keeps every matrix whole). The default keeps a team within a node of 8.
        flops_per_element: What sending one element to another rank costs, in FLOPs of the same
            time (``flops`` cost only; it prices teams' collectives). Default: an H100's
            effective bf16 matmul rate (593.6 TFLOP/s) over NVLink's 450 GB/s, at 2 bytes per
            element (`simulation.DeviceModel.plan_prices` gives a device's, in a rule's dtype).
        flops_per_message: What one collective costs in latency, in FLOPs (default: 3 µs at
            593.6 TFLOP/s; it prices teams' collectives and sets how many micro-groups pay).
        exchange_flops_per_element: What a micro-group's gather or scatter costs per element
            that its busiest rank sends or receives, in FLOPs (``flops`` cost only). Default: an
            H100's 593.6 TFLOP/s over InfiniBand's 50 GB/s, at 2 bytes per element (a mesh past
            one node).
        exchange_flops_per_message: What a gather or scatter costs per peer a rank exchanges
            with, in FLOPs (default: 6 µs at 593.6 TFLOP/s). With the element price, it decides
            between the micro-groups that teams' smaller items allow and the fewer that whole
            matrices get (`estimated_step`).
    """

    policy: str = "canzona"
    alpha: float = 0.5
    cost: CostKind = "flops"
    capacity: float | None = None
    locality: bool = True
    max_team: int = 8
    flops_per_element: float = 2638.4
    flops_per_message: float = 1.78092e9
    exchange_flops_per_element: float = 23745.6
    exchange_flops_per_message: float = 3.56184e9

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cost not in COST_KINDS:
            raise ValueError(f"cost must be one of {COST_KINDS}, got {self.cost!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.capacity is not None and not self.capacity > 0:
            raise ValueError(f"micro_group_capacity must be > 0 or None, got {self.capacity}")
        if self.max_team not in (1, *TEAM_SIZES):
            raise ValueError(f"max_team must be one of {(1, *TEAM_SIZES)}, got {self.max_team}")


@dataclass(frozen=True)
class Plan:
    """The outcome of planning.

    Attributes:
        settings: The settings it was built with.
        matrices: The matrices, in model order.
        dp: Data-parallel size of the mesh.
        tp: Tensor-parallel size of the mesh; rank ``r = d·tp + t``.
        owners: Owner rank of each matrix (a team's first member); ``None`` under ``sync``
            (every rank computes all).
        micro_groups: Matrix indices of each micro-group, in pipeline order.
        capacity: The capacity used.
        fell_back: ``canzona`` did not beat round-robin and took its owners.
        teams: The ranks that compute each matrix, in member order; ``None`` under ``sync``.
            Defaults to each owner alone.
        loads: Each matrix's cost to each rank that computes it, in member order, per step
            (periodic work amortised; `steady` and `peaks`: on a step without it, with it).
    """

    settings: PlanSettings
    matrices: tuple[MatrixSpec, ...]
    dp: int
    tp: int
    owners: tuple[int, ...] | None
    micro_groups: tuple[tuple[int, ...], ...]
    capacity: float
    fell_back: bool = False
    teams: tuple[tuple[int, ...], ...] | None = None
    loads: tuple[tuple[float, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.teams is None and self.owners is not None:
            object.__setattr__(self, "teams", tuple((owner,) for owner in self.owners))
        object.__setattr__(self, "loads", self._member_loads("amortised"))

    @functools.cached_property
    def steady(self) -> tuple[tuple[float, ...], ...]:
        """`loads` on a step without the periodic work."""
        return self._member_loads("steady")

    @functools.cached_property
    def peaks(self) -> tuple[tuple[float, ...], ...]:
        """`loads` on a step that runs the periodic work (decompositions)."""
        return self._member_loads("peak")

    def _member_loads(self, step: Step) -> tuple[tuple[float, ...], ...]:
        sizes = [1] * len(self.matrices) if self.teams is None else [len(team) for team in self.teams]
        return tuple(member_loads(m, size, self.settings, step) for m, size in zip(self.matrices, sizes))

    @property
    def num_ranks(self) -> int:
        return self.dp * self.tp

    @property
    def ideal(self) -> float:
        """The whole matrices' total cost over the ranks: what a perfectly divided step costs."""
        return ideal_load(self.matrices, self.num_ranks, self.settings.cost)

    def split_matrices(self) -> dict[int, int]:
        """Team size → how many matrices teams of that size compute."""
        sizes: dict[int, int] = {}
        for team in self.teams or ():
            if len(team) > 1:
                sizes[len(team)] = sizes.get(len(team), 0) + 1
        return dict(sorted(sizes.items()))

    @property
    def period(self) -> int:
        """Steps between the periodic work of the matrices' rules (`shortest_period`)."""
        return shortest_period(self.matrices)

    def rank_loads(self) -> list[float]:
        """Total cost each rank computes per step (periodic work amortised)."""
        return self._host_loads(range(len(self.matrices)), self.loads)

    def rank_peaks(self) -> list[float]:
        """Total cost each rank computes on a step that runs the periodic work."""
        return self._host_loads(range(len(self.matrices)), self.peaks)

    def rank_state_bytes(self) -> list[int]:
        """Optimizer-state bytes each rank holds: the matrix state of what it computes (a
        member's part of a team's) and its even share of every matrix's elementwise state."""
        num_ranks = self.num_ranks
        state = [sum(m.cost.elementwise_state_bytes for m in self.matrices) // num_ranks] * num_ranks
        for index, matrix in enumerate(self.matrices):
            team = range(num_ranks) if self.teams is None else self.teams[index]
            held = matrix.member_cost(1 if self.teams is None else len(team)).matrix_state_bytes
            for rank in team:
                state[rank] += held
        return state

    def state_max_over_mean(self) -> float:
        """The most state on a rank over the mean (1.0: balanced)."""
        return max_over_mean(self.rank_state_bytes())

    def average_makespan(self) -> float:
        """The busiest rank's cost averaged over a period of the periodic work: ``p − 1`` steps
        of the busiest rank without it and one of the busiest with it. Every rank waits for the
        busiest at each step, so a plan balanced only in amortised loads takes longer where the
        decompositions crowd onto a few ranks."""
        return self.averaged(
            lambda loads: max(self._host_loads(range(len(self.matrices)), loads), default=0.0)
        )

    def averaged(self, time: Callable[[Sequence[Sequence[float]]], float]) -> float:
        """``time`` of member loads averaged over a `period`: of the `steady` loads on all steps
        but one, of the `peaks` on that one (where rules differ in period, as if all had the
        shortest)."""
        if self.period == 1:
            return time(self.loads)
        return averaged_over_period(time(self.steady), time(self.peaks), self.period)

    def group_host_loads(
        self, group: tuple[int, ...], loads: Sequence[Sequence[float]] | None = None
    ) -> list[float]:
        """Cost each rank computes within one micro-group (of ``loads``, by default `loads`)."""
        return self._host_loads(group, self.loads if loads is None else loads)

    def _host_loads(self, indices: Iterable[int], loads: Sequence[Sequence[float]]) -> list[float]:
        if self.teams is None:
            return [sum(loads[i][0] for i in indices)] * self.num_ranks
        totals = [0.0] * self.num_ranks
        for index in indices:
            for rank, load in zip(self.teams[index], loads[index]):
                totals[rank] += load
        return totals


def max_over_mean(values: Sequence[float]) -> float:
    """The largest of ``values`` over their mean (1.0 where the mean is 0)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def ideal_load(matrices: Sequence[MatrixSpec], num_ranks: int, cost: CostKind) -> float:
    """The whole matrices' total ``cost`` over ``num_ranks``: a perfectly divided step."""
    return sum(m.load(cost) for m in matrices) / num_ranks


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


def member_loads(
    matrix: MatrixSpec, team: int, settings: PlanSettings, step: Step = "amortised"
) -> tuple[float, ...]:
    """What ``matrix`` costs each member of a team of ``team`` ranks on the ``step``
    (`MatrixSpec.member_loads`), in member order and the cost's unit: under ``flops``, its FLOPs
    plus the team's collectives at the settings' exchange rates."""
    loads = matrix.member_loads(settings.cost, team, step)
    if team > 1 and settings.cost == "flops":
        cost = matrix.member_cost(team)
        collectives = (
            cost.team_numel * settings.flops_per_element + cost.team_messages * settings.flops_per_message
        )
        loads = tuple(load + collectives for load in loads)
    return loads


def team_sizes(
    matrices: list[MatrixSpec], num_ranks: int, settings: PlanSettings, pairs: bool = True
) -> list[int]:
    """How many ranks compute each matrix (see the module docstring).

    Teams trade a larger total (their collectives) for smaller items. Matrices of the same cost
    form a class, split alike. Greedily, the class and team size that lower `_packing_bound` (with
    its pair bound if ``pairs``) the most are taken, while one lowers it (or keeps it at no cost:
    free collectives). A matrix that some ranks hold whole stays whole: updated where it lies, it
    moves nothing.
    """
    members, options, loads = _team_classes(matrices, num_ranks, settings)
    chosen = [1] * len(members)

    def bound(sizes: list[int]) -> tuple[float, float]:
        """The packing bound and the total load with each class split in ``sizes``."""
        split = [(len(group), size, load[size]) for group, size, load in zip(members, sizes, loads)]
        return _packing_bound(split, num_ranks, pairs), _total(split)

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
    members, options, loads = _team_classes(matrices, num_ranks, settings)
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
    """Team sizes found by packing them (`_greedy_makespan`): candidates beside `team_sizes`.

    `_packing_bound` cannot see that ranks holding an item above half the makespan have room for
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
    members, options, loads = _team_classes(matrices, num_ranks, settings, busiest)

    def packed(counts: list[dict[int, int]]) -> tuple[float, float]:
        classes = [(n, k, load[k]) for sizes, load in zip(counts, loads) for k, n in sizes.items() if n]
        return _greedy_makespan(classes, num_ranks), _total(classes)

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
            combinations.append((_packing_bound(classes, num_ranks), combination))
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
    return [_sizes_of(members, counts, len(matrices)) for counts in (uniform, best[1])]


def _sizes_of(members: list[list[int]], counts: list[dict[int, int]], num_matrices: int) -> list[int]:
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


def _total(classes: Classes) -> float:
    """The total load of classes of ``(count, team size, member loads)``."""
    return sum(n * sum(loads) for n, _, loads in classes)


def _greedy_makespan(classes: Classes, num_ranks: int) -> float:
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


def _team_classes(
    matrices: list[MatrixSpec],
    num_ranks: int,
    settings: PlanSettings,
    busiest: bool = False,
    step: Step = "amortised",
) -> tuple[list[list[int]], list[list[int]], list[dict[int, tuple[float, ...]]]]:
    """The matrices of equal cost as classes: each class's indices, its team sizes (1 only for a
    matrix that some ranks hold whole) and its member loads on the ``step`` at each size (each
    the busiest member's if ``busiest``)."""
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
    """A lower bound on the makespan of every plan whose teams have at most ``settings.max_team``
    ranks, at the settings' prices of their collectives (`member_loads`), on the ``step``.

    Whatever the team sizes, the makespan is at least the largest member load and the mean
    member load over the ranks. For each limit on the former, each matrix takes the size within
    it that adds the least load (a team adds its collectives); the bound is the least over the
    limits. Unlike the ideal ``total / ranks``, no plan beats it: where it exceeds the ideal, the
    excess is what teams' collectives cost at the least to bring every item under the ideal.
    """
    classes = list(zip(*_team_classes(matrices, num_ranks, settings, step=step)))
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
    """A lower bound on `Plan.average_makespan` of every plan whose teams have at most
    ``settings.max_team`` ranks: `team_bound` of the steps without the periodic work and of the
    step with it, averaged over the period. Where one decomposition outweighs a rank's share of
    that step, no placement of it does better."""
    period = shortest_period(matrices)
    if period == 1:
        return team_bound(matrices, num_ranks, settings)
    steady, peak = (team_bound(matrices, num_ranks, settings, step) for step in ("steady", "peak"))
    return averaged_over_period(steady, peak, period)


def shortest_period(matrices: Iterable[MatrixSpec]) -> int:
    """Steps between the periodic work of the matrices' rules (the shortest; 1: none)."""
    return min((m.cost.period for m in matrices if any(m.cost.periodic_flops)), default=1)


def _packing_bound(classes: Classes, num_ranks: int, pairs: bool = True) -> float:
    """A lower bound on the makespan of classes of ``(count, team size, member loads)``: the mean
    load, the largest member load, per class its items on the aligned blocks (``count · size``
    member slots over ``num_ranks`` ranks: some rank takes ``⌈count · size / ranks⌉``, each at
    least the least member load), and if ``pairs`` the pair bound: of the ``ranks + 1`` largest
    member loads, two share a rank."""
    largest = max((max(loads) for _, _, loads in classes), default=0.0)
    packed = max((math.ceil(n * k / num_ranks) * min(loads) for n, k, loads in classes), default=0.0)
    pair = _pair_bound(classes, num_ranks) if pairs else 0.0
    return max(_total(classes) / num_ranks, largest, packed, pair)


def _pair_bound(classes: Classes, num_ranks: int) -> float:
    """``L[ranks] + L[ranks + 1]``, the ``ranks``-th and next largest member loads (0 if fewer)."""
    pair, seen = [], 0
    for n, load in sorted(((n, load) for n, _, loads in classes for load in loads), key=lambda c: -c[1]):
        seen += n
        while len(pair) < 2 and seen >= num_ranks + len(pair):
            pair.append(load)
    return sum(pair) if len(pair) == 2 else 0.0


def _fixed_owner_plan(settings, matrices, dp, tp, owners, capacity, fell_back=False) -> Plan:
    groups = sequential_groups(owners, [m.load(settings.cost) for m in matrices], capacity)
    return Plan(
        settings, tuple(matrices), dp, tp, tuple(owners), tuple(map(tuple, groups)), capacity, fell_back
    )


def _team_plan(
    settings: PlanSettings, matrices: list[MatrixSpec], dp: int, tp: int, sizes: list[int]
) -> Plan:
    """canzona's plan with each matrix computed by ``sizes[i]`` ranks."""
    num_ranks = dp * tp
    loads = [member_loads(m, size, settings) for m, size in zip(matrices, sizes)]
    whole_loads = [m.load(settings.cost) for m in matrices]
    buckets = [m.bucket for m in matrices]
    holders = [m.holders for m in matrices] if settings.locality else None
    # Teams' smaller items let the packer cut more micro-groups than whole matrices get; more
    # groups overlap more, but each waits for its own busiest rank's gather and scatter. Both
    # capacities are planned where they differ, and the shorter estimated step is kept. Where
    # members cost differently, the packer places them as they cost and, as a second candidate,
    # as if each cost the busiest's: it places each item once, largest first, so lighter items
    # can pack worse (Qwen3 32B with Shampoo at 128 ranks: 1.028 × the ideal against 1.010).
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


def estimated_step(plan: Plan) -> float:
    """The plan's pipelined optimizer step in the cost's unit (`pipeline.pipelined_time`),
    averaged over a period of the periodic work (`Plan.averaged`).

    A micro-group computes as long as its busiest rank; under ``flops`` its gather and its
    scatter each cost the busiest rank's elements (what it receives of the slices it computes,
    or its shards of the group's matrices) and a message to every other rank, at the settings'
    exchange prices. Cheap (linear in the matrices; a matrix that its owner holds whole counted
    as moved): an estimate to choose between plans, not the traffic (`planning.traffic`) or the
    simulator's projection.
    """
    settings = plan.settings

    def computes(loads: Sequence[Sequence[float]]) -> list[float]:
        return [max(plan.group_host_loads(group, loads)) for group in plan.micro_groups]

    if settings.cost != "flops" or plan.teams is None:
        return plan.averaged(lambda loads: sum(computes(loads)))
    messages = (plan.num_ranks - 1) * settings.exchange_flops_per_message  # one to every peer
    exchanges = []
    for group in plan.micro_groups:
        received = [0.0] * plan.num_ranks
        for index in group:
            team = plan.teams[index]
            for rank in team:
                received[rank] += plan.matrices[index].cost.numel / len(team)
        sent = sum(plan.matrices[index].cost.numel for index in group) / plan.num_ranks
        exchanges.append(max(*received, sent) * settings.exchange_flops_per_element + messages)
    return plan.averaged(lambda loads: pipelined_time(exchanges, computes(loads), exchanges))


def _scored(plan: Plan) -> tuple[float, Plan]:
    return estimated_step(plan), plan


def _descend(
    matrices: list[MatrixSpec],
    dp: int,
    tp: int,
    settings: PlanSettings,
    scored: dict[tuple[int, ...], tuple[float, Plan]],
) -> None:
    """Adds to ``scored`` (team sizes → estimated step and plan) the plans of a descent on the
    estimated step over team sizes set class by class.

    The candidates are chosen by the compute they pack (`team_sizes`, `searched_sizes`), blind
    to the gathers and scatters that the estimated step prices, which at hundreds of ranks are
    most of it. From the shortest candidate, each class at its most common size, every change
    of one class's size is planned, and the shortest is taken while it shortens the step, for
    at most `DESCENT_ROUNDS` rounds (Qwen3 8B with Muon at 256 ranks: 9 % shorter).
    """
    members, options, _ = _team_classes(matrices, dp * tp, settings)

    def step_of(choice: tuple[int, ...]) -> float:
        sizes = [1] * len(matrices)
        for group, size in zip(members, choice):
            for index in group:
                sizes[index] = size
        key = tuple(sizes)
        if key not in scored:
            scored[key] = _scored(_team_plan(settings, matrices, dp, tp, sizes))
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
    """Plan the updates of ``matrices`` on a ``dp × tp`` mesh.

    Args:
        matrices: The matrices in model order.
        dp: Data-parallel size (1 for a tensor-parallel-only mesh).
        tp: Tensor-parallel size (1 for a data-parallel-only mesh).
        settings: Policy, α, cost and capacity.

    Returns:
        The plan; identical for identical inputs.
    """
    settings = settings or PlanSettings()
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
        return _fixed_owner_plan(
            settings, matrices, dp, tp, partition.round_robin(loads, num_ranks), capacity
        )
    if settings.policy == "lpt":
        owners = partition.longest_processing_time(loads, num_ranks)
        return _fixed_owner_plan(settings, matrices, dp, tp, owners, capacity)
    # The greedy choice of teams is myopic: with and without the pair bound it can take other
    # paths, and it splits classes alike; those, the overflow's splits and the searched sizes
    # (members priced as they are, and each as the busiest) are planned (where they differ), with
    # those of a descent from the shortest (`_descend`), and of the plans within `STEP_TOLERANCE`
    # of the shortest estimated step one that balances the state, then the one of the shortest
    # makespan on average, is kept. By makespan alone, sizes that balance the compute better but
    # make the busiest rank receive more were kept: Qwen3 14B with Muon at 256 ranks, a makespan
    # of 1.30 × the ideal against 1.42, and a simulated step of 26.2 ms against 20.2.
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
    by_sizes = {sizes: _scored(_team_plan(settings, matrices, dp, tp, list(sizes))) for sizes in candidates}
    _descend(matrices, dp, tp, settings, by_sizes)
    scored = list(by_sizes.values())
    shortest = min(step for step, _ in scored)
    alike = [(step, plan) for step, plan in scored if step <= (1 + STEP_TOLERANCE) * shortest]
    # Alike in speed, a plan that balances the optimizer state (what sets a rank's memory) first.
    balanced = [(step, plan) for step, plan in alike if plan.state_max_over_mean() <= STATE_BALANCE]
    step, plan = min(balanced or alike, key=lambda scored_plan: scored_plan[1].average_makespan())
    if plan.split_matrices():  # teams must pack better than whole matrices, not only bound better
        whole = build_plan(matrices, dp, tp, replace(settings, max_team=1))
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
        settings, matrices, dp, tp, partition.round_robin(loads, num_ranks), capacity, fell_back=True
    )
    return plan if plan.average_makespan() <= naive.average_makespan() else naive
