"""A plan: who computes which matrix's update, in which micro-group, and what that costs.

`PlanSettings` says how to plan, `Plan` is the outcome with its measures (loads, state,
`estimated_step`); `policies.build_plan` builds it (docs/architecture.md#planning)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import InitVar, dataclass, field

from lightning_canzona.planning.devices import H100, PRICE_NAMES, CollectivePrices
from lightning_canzona.planning.matrices import COST_KINDS, TEAM_SIZES, CostKind, MatrixSpec, Step
from lightning_canzona.planning.memory import MemoryBudget, StepMemory, estimated_buffers, step_memory

POLICIES: tuple[str, ...] = ("canzona", "lpt", "round_robin", "sync")


#: The default prices of collectives: an H100's, in bf16 FLOPs of 2-byte elements.
DEFAULT_PRICES: CollectivePrices = H100.prices("bfloat16", 2)


@dataclass(frozen=True)
class PlanSettings:
    """How to plan. The prices of collectives default to an H100's in bf16 FLOPs
    (docs/planning.md#device-model, "Prices of collectives").

    Attributes:
        policy: One of ``canzona``, ``lpt``, ``round_robin``, ``sync``.
        alpha: ``canzona``'s balance between per-bucket uniformity (0) and global balance (1).
        cost: What to balance: ``flops`` of the updates or ``numel`` of the matrices.
        capacity: Largest host load of a micro-group, in the cost's unit; ``None`` derives it from
            the model (about two groups per rank, at least the largest matrix).
        locality: ``canzona`` gives a matrix that some ranks hold whole to one of them; ``False``
            plans as if every matrix were fragmented.
        max_team: Most ranks that ``canzona`` lets compute one matrix's update together (a power
            of two; 1 keeps every matrix whole). The default keeps a team within a node of 8.
        flops_per_element: One element sent within a team, in FLOPs of the same time (``flops`` cost).
        flops_per_message: One collective's latency, in FLOPs (teams' and micro-groups').
        exchange_flops_per_element: One element a gather or scatter moves for its busiest rank.
        exchange_flops_per_message: One peer a rank exchanges with in a gather or scatter.
        prices: The four prices as one `devices.CollectivePrices` (what a device reprices); the
            four are keywords of the constructor and of ``dataclasses.replace``, and read-only.
        memory_budget: What the step's buffers may hold at their peak on a rank (``None``: no
            bound); micro-groups are cut to meet it (docs/memory.md).
        overlap: The micro-groups run pipelined (what the memory model assumes).
    """

    policy: str = "canzona"
    alpha: float = 0.5
    cost: CostKind = "flops"
    capacity: float | None = None
    locality: bool = True
    max_team: int = 8
    memory_budget: MemoryBudget | None = MemoryBudget()
    overlap: bool = True
    flops_per_element: InitVar[float] = DEFAULT_PRICES.flops_per_element
    flops_per_message: InitVar[float] = DEFAULT_PRICES.flops_per_message
    exchange_flops_per_element: InitVar[float] = DEFAULT_PRICES.exchange_flops_per_element
    exchange_flops_per_message: InitVar[float] = DEFAULT_PRICES.exchange_flops_per_message
    prices: CollectivePrices = field(init=False)

    def __post_init__(
        self,
        flops_per_element: float,
        flops_per_message: float,
        exchange_flops_per_element: float,
        exchange_flops_per_message: float,
    ) -> None:
        prices = CollectivePrices(
            flops_per_element, flops_per_message, exchange_flops_per_element, exchange_flops_per_message
        )
        object.__setattr__(self, "prices", prices)
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


def _price(name: str) -> property:
    return property(lambda settings: getattr(settings.prices, name), doc=f"``prices.{name}``")


# Each price, read from the record the settings hold. Set after the class: in its body the name is
# the constructor's keyword (and `dataclasses.replace` passes on a keyword's value read by name).
for _name in PRICE_NAMES:
    setattr(PlanSettings, _name, _price(_name))


@dataclass(frozen=True)
class Plan:
    """The outcome of planning.

    Attributes:
        matrices: The matrices, in model order.
        tp: Tensor-parallel size of the mesh; rank ``r = d·tp + t``.
        owners: Owner rank of each matrix (a team's first member); ``None`` under ``sync``.
        micro_groups: Matrix indices of each micro-group, in pipeline order.
        fell_back: ``canzona`` did not beat round-robin and took its owners.
        teams: The ranks that compute each matrix, in member order (default: each owner alone).
        loads: Each matrix's cost to each rank that computes it, in member order, periodic work
            amortised (`steady` and `peaks`: on a step without it, with it).
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
        """Optimizer-state bytes per rank: its matrices' matrix state, a share of elementwise state."""
        num_ranks = self.num_ranks
        state = [sum(m.cost.elementwise_state_bytes for m in self.matrices) // num_ranks] * num_ranks
        for index, matrix in enumerate(self.matrices):
            team = range(num_ranks) if self.teams is None else self.teams[index]
            held = matrix.member_cost(1 if self.teams is None else len(team)).matrix_state_bytes
            for rank in team:
                state[rank] += held
        return state

    def rank_memory(self) -> list[StepMemory]:
        """What each rank's step holds: its arena of exchange buffers and its peak (docs/memory.md)."""
        ranks = estimated_buffers(self.matrices, self.teams, self.micro_groups, self.num_ranks)
        return [step_memory(tuple(groups), self.settings.overlap) for groups in ranks]

    def matrix_bytes(self) -> float:
        """Bytes of the matrices a rank holds, on average: what a fraction of a budget is of."""
        return sum(m.cost.numel * m.param_bytes for m in self.matrices) / self.num_ranks

    def memory_target(self) -> float | None:
        """The budget of a rank's step buffers in bytes (``None``: unbounded)."""
        budget = self.settings.memory_budget
        return None if budget is None else budget.bytes_for(self.matrix_bytes())

    def state_max_over_mean(self) -> float:
        """The most state on a rank over the mean (1.0: balanced)."""
        return max_over_mean(self.rank_state_bytes())

    def average_makespan(self) -> float:
        """The busiest rank's cost averaged over a `period`: ``p − 1`` steady steps and one peak."""
        return self.averaged(
            lambda loads: max(self._host_loads(range(len(self.matrices)), loads), default=0.0)
        )

    def averaged(self, time: Callable[[Sequence[Sequence[float]]], float]) -> float:
        """``time`` of the `steady` loads on ``p − 1`` steps and of the `peaks` on one, averaged."""
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


def member_loads(
    matrix: MatrixSpec, team: int, settings: PlanSettings, step: Step = "amortised"
) -> tuple[float, ...]:
    """What ``matrix`` costs each member of a team of ``team`` on the ``step``, collectives included."""
    loads = matrix.member_loads(settings.cost, team, step)
    if team > 1 and settings.cost == "flops":
        cost = matrix.member_cost(team)
        collectives = (
            cost.team_numel * settings.flops_per_element + cost.team_messages * settings.flops_per_message
        )
        loads = tuple(load + collectives for load in loads)
    return loads


def shortest_period(matrices: Iterable[MatrixSpec]) -> int:
    """Steps between the periodic work of the matrices' rules (the shortest; 1: none)."""
    return min((m.cost.period for m in matrices if any(m.cost.periodic_flops)), default=1)


def estimated_step(plan: Plan, replicas: int = 1) -> float:
    """The plan's estimated pipelined step, averaged over the period, with ``replicas`` copies of
    every matrix (HSDP's, spread): docs/architecture.md#planning, "Estimated step"."""
    settings = plan.settings

    def computes(loads: Sequence[Sequence[float]]) -> list[float]:
        return [max(plan.group_host_loads(group, loads)) for group in plan.micro_groups]

    if settings.cost != "flops" or plan.teams is None:
        return plan.averaged(lambda loads: sum(computes(loads)))
    messages = (plan.num_ranks - 1) * settings.exchange_flops_per_message  # one to every peer
    gathers, scatters = [], []
    for group in plan.micro_groups:
        received = [0.0] * plan.num_ranks
        for index in group:
            team = plan.teams[index]
            for rank in team:
                received[rank] += plan.matrices[index].cost.numel / len(team)
        held = sum(plan.matrices[index].cost.numel for index in group) * replicas / plan.num_ranks
        price = settings.exchange_flops_per_element
        gathers.append(max(*received, held) * price + messages)
        scatters.append(max(max(received) * replicas, held) * price + messages)
    return plan.averaged(lambda loads: pipelined_time(gathers, computes(loads), scatters))


# The micro-group pipeline's schedules: gather → compute → scatter per group. The network's order,
# and why pipelining never takes longer: docs/architecture.md#planning, "Estimated step".


def sequential_time(gathers: Sequence[float], computes: Sequence[float], scatters: Sequence[float]) -> float:
    """Time when every gather, compute and scatter runs after the previous one."""
    return sum(gathers) + sum(computes) + sum(scatters)


def averaged_over_period(steady: float, peak: float, period: int) -> float:
    """A step's time averaged over ``period`` steps: ``steady`` on all but one, ``peak`` on one."""
    return ((period - 1) * steady + peak) / period


def pipelined_time(gathers: Sequence[float], computes: Sequence[float], scatters: Sequence[float]) -> float:
    """Time when the network runs ``gather 0, gather 1, scatter 0, gather 2, …`` beside compute."""
    count = len(gathers)
    if not (len(computes) == len(scatters) == count):
        raise ValueError("gathers, computes and scatters need one entry per micro-group")
    if count == 0:
        return 0.0
    gather_done = [0.0] * count
    compute_done = [0.0] * count
    network_free = 0.0
    compute_free = 0.0
    end = 0.0

    def run_gather(group: int) -> None:
        nonlocal network_free
        network_free += gathers[group]
        gather_done[group] = network_free

    def run_compute(group: int) -> None:
        nonlocal compute_free
        compute_free = max(compute_free, gather_done[group]) + computes[group]
        compute_done[group] = compute_free

    def run_scatter(group: int) -> None:
        nonlocal network_free, end
        network_free = max(network_free, compute_done[group]) + scatters[group]
        end = max(end, network_free)

    run_gather(0)
    for group in range(count):
        run_compute(group)  # only depends on gathers already issued
        if group + 1 < count:
            run_gather(group + 1)
        run_scatter(group)
    return max(end, compute_free)
