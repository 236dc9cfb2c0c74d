"""The plan report: per-rank load and state, balance, bounds, and a printable table."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_canzona.planning.bounds import average_bound, team_bound
from lightning_canzona.planning.plan import Plan, max_over_mean

#: How each cost kind is printed: ``(divisor, unit)``.
COST_UNITS = {"flops": (1e9, "GFLOP"), "numel": (1e6, "M elements")}


@dataclass(frozen=True)
class PlanReport:
    """Numbers that tell how good a plan is.

    Attributes:
        policy: The plan's policy (``canzona*`` when it fell back to round-robin owners).
        rank_state_bytes: Optimizer-state bytes each rank holds (`Plan.rank_state_bytes`).
        lower_bound: ``max(largest matrix, total / ranks)``: no plan of whole matrices does better.
        ideal: ``total / ranks``: the whole matrices' cost perfectly divided.
        team_bound: No plan with teams of at most ``max_team`` ranks does better (`bounds.team_bound`).
        makespan: The largest rank load (periodic work amortised).
        average_makespan: The busiest rank's load averaged over the period (`Plan.average_makespan`).
        peak_makespan: The largest rank load on a step that runs the periodic work.
        average_bound: No such plan has a shorter average makespan (`bounds.average_bound`).
        period: Steps between runs of the periodic work (1: none).
        synchronized_makespan: Σ over micro-groups of the group's largest host load.
        split_matrices: Team size → matrices that teams of that size compute together.
    """

    policy: str
    cost: str
    rank_loads: list[float]
    rank_matrices: list[int]
    rank_state_bytes: list[int]
    lower_bound: float
    ideal: float
    team_bound: float
    makespan: float
    average_makespan: float
    peak_makespan: float
    average_bound: float
    period: int
    synchronized_makespan: float
    num_micro_groups: int
    split_matrices: dict[int, int]

    @property
    def max_over_mean(self) -> float:
        return max_over_mean(self.rank_loads)

    @property
    def makespan_over_bound(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def makespan_over_ideal(self) -> float:
        return self.makespan / self.ideal if self.ideal > 0 else 1.0

    @property
    def average_over_ideal(self) -> float:
        return self.average_makespan / self.ideal if self.ideal > 0 else 1.0

    @property
    def state_max_over_mean(self) -> float:
        return max_over_mean(self.rank_state_bytes)

    def table(self) -> str:
        """A per-rank table with the summary underneath."""
        scale, unit = COST_UNITS[self.cost]
        lines = [f"{'rank':>5} {'load [' + unit + ']':>18} {'matrices':>9} {'state [MiB]':>12}"]
        for rank, (load, count, state) in enumerate(
            zip(self.rank_loads, self.rank_matrices, self.rank_state_bytes)
        ):
            lines.append(f"{rank:>5} {load / scale:>18.3f} {count:>9} {state / 2**20:>12.2f}")
        lines.append(
            f"policy {self.policy}, cost {self.cost}: max/mean {self.max_over_mean:.3f}, "
            f"makespan/bound {self.makespan_over_bound:.3f}, makespan/ideal {self.makespan_over_ideal:.3f} "
            f"(team bound/ideal {self.team_bound / self.ideal:.3f}), "
            f"synchronized makespan/bound {self.synchronized_makespan / self.lower_bound:.3f} "
            f"over {self.num_micro_groups} micro-groups"
            if self.lower_bound > 0
            else f"policy {self.policy}: nothing to plan"
        )
        if self.peak_makespan > self.makespan:
            lines.append(
                f"decompositions every {self.period} steps: those steps' makespan/ideal "
                f"{self.peak_makespan / self.ideal:.3f}, the average step's {self.average_over_ideal:.3f} "
                f"(its bound {self.average_bound / self.ideal:.3f})"
            )
        if self.split_matrices:
            teams = ", ".join(f"{count} by {size} ranks" for size, count in self.split_matrices.items())
            lines.append(f"computed by teams: {teams}")
        return "\n".join(lines)


def report(plan: Plan) -> PlanReport:
    """Measure ``plan``."""
    num_ranks = plan.num_ranks
    matrices = plan.matrices
    counts = [0] * num_ranks
    for team in plan.teams or [range(num_ranks)] * len(matrices):
        for rank in team:
            counts[rank] += 1
    loads = plan.rank_loads()
    bound = team_bound(list(matrices), num_ranks, plan.settings)
    policy = plan.settings.policy + (" (round-robin owners)" if plan.fell_back else "")
    return PlanReport(
        policy=policy,
        cost=plan.settings.cost,
        rank_loads=loads,
        rank_matrices=counts,
        rank_state_bytes=plan.rank_state_bytes(),
        lower_bound=max(max((m.load(plan.settings.cost) for m in matrices), default=0.0), plan.ideal),
        ideal=plan.ideal,
        team_bound=bound,
        makespan=max(loads, default=0.0),
        average_makespan=plan.average_makespan(),
        peak_makespan=max(plan.rank_peaks(), default=0.0),
        average_bound=average_bound(list(matrices), num_ranks, plan.settings) if plan.period > 1 else bound,
        period=plan.period,
        synchronized_makespan=sum(max(plan.group_host_loads(group)) for group in plan.micro_groups),
        num_micro_groups=len(plan.micro_groups),
        split_matrices=plan.split_matrices(),
    )
