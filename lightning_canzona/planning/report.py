"""The plan report: per-rank load, state and step memory, balance, bounds, and a printable table."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_canzona.planning.bounds import average_bound, team_bound
from lightning_canzona.planning.memory import estimated_buffers, size_text, step_memory
from lightning_canzona.planning.plan import Plan, max_over_mean

#: How each cost kind is printed: ``(divisor, unit)``.
COST_UNITS = {"flops": (1e9, "GFLOP"), "numel": (1e6, "M elements")}


@dataclass(frozen=True)
class PlanReport:
    """Numbers that tell how good a plan is.

    Attributes:
        policy: The plan's policy (``canzona*`` when it fell back to round-robin owners).
        rank_state_bytes: Optimizer-state bytes each rank holds (`Plan.rank_state_bytes`).
        rank_peak_bytes: Bytes each rank's step buffers hold at their peak (`Plan.rank_memory`).
        matrix_bytes: Bytes of the matrices a rank holds, on average (`Plan.matrix_bytes`): what a
            budget's fraction and `peak_over_matrix_bytes` are of.
        memory_target: The budget of a rank's step buffers in bytes (``None``: unbounded).
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
    rank_peak_bytes: list[int]
    matrix_bytes: float
    memory_target: float | None
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

    @property
    def adamw_state_bytes(self) -> float:
        """AdamW's state of the same matrices on a rank: two moments in the parameters' dtype
        (``2 × numel × param_bytes``), spread evenly as `Plan.rank_state_bytes` spreads
        elementwise state."""
        return 2 * self.matrix_bytes

    @property
    def peak_over_matrix_bytes(self) -> float:
        """The busiest rank's step buffers at their peak over `matrix_bytes`: what a budget's
        fraction bounds (0.0 without matrices)."""
        return max(self.rank_peak_bytes, default=0) / self.matrix_bytes if self.matrix_bytes else 0.0

    @property
    def memory_over_adamw(self) -> float:
        """The most any rank holds of state and step buffers at their peak together, over
        `adamw_state_bytes`: what the optimizer needs beside parameters and gradients, against
        AdamW's (0.0 without matrices)."""
        held = max(map(sum, zip(self.rank_state_bytes, self.rank_peak_bytes)), default=0)
        return held / self.adamw_state_bytes if self.matrix_bytes else 0.0

    @property
    def budget_over_matrix_bytes(self) -> float | None:
        """`memory_target` over `matrix_bytes` (``None``: no budget)."""
        if self.memory_target is None or not self.matrix_bytes:
            return None
        return self.memory_target / self.matrix_bytes

    def table(self) -> str:
        """A per-rank table with the summary underneath."""
        scale, unit = COST_UNITS[self.cost]
        lines = [
            f"{'rank':>5} {'load [' + unit + ']':>18} {'matrices':>9} {'state [MiB]':>12} {'peak [MiB]':>11}"
        ]
        for rank, (load, count, state, peak) in enumerate(
            zip(self.rank_loads, self.rank_matrices, self.rank_state_bytes, self.rank_peak_bytes)
        ):
            lines.append(
                f"{rank:>5} {load / scale:>18.3f} {count:>9} {state / 2**20:>12.2f} {peak / 2**20:>11.2f}"
            )
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
        if self.matrix_bytes:
            budget = self.budget_over_matrix_bytes
            lines.append(
                f"step buffers at their peak {max(self.rank_peak_bytes) / 2**20:.1f} MiB "
                f"({self.peak_over_matrix_bytes:.2f}× the rank's matrix bytes, "
                f"{'no budget' if budget is None else f'budget {budget:.2f}×'}); "
                f"state + peak = {self.memory_over_adamw:.2f}× AdamW's state"
            )
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
        rank_peak_bytes=[memory.peak for memory in plan.rank_memory()],
        matrix_bytes=plan.matrix_bytes(),
        memory_target=plan.memory_target(),
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


def least_peak(plan: Plan) -> tuple[int, int]:
    """The least peak that cutting ``plan``'s micro-groups can reach, and the matrix that sets it.

    That is the busiest rank's peak in a step whose one micro-group is a matrix alone, its teams
    as planned, for the matrix where that is largest: no budget below it can be met (a pipeline
    adds its neighbours' buffers, so a plan cut to it may hold more). Matrices alike but for their
    ranks (the same spec, team and holders up to renaming the ranks) are measured once.

    Returns:
        ``(bytes, index of the matrix)``; ``(0, -1)`` without matrices.
    """
    measured: dict[tuple, int] = {}
    peaks = []
    for index, matrix in enumerate(plan.matrices):
        team = None if plan.teams is None else plan.teams[index]
        renamed = {rank: k for k, rank in enumerate(dict.fromkeys([*(team or ()), *matrix.holders]))}
        alike = replace(matrix, name="", bucket="", holders=tuple(renamed[rank] for rank in matrix.holders))
        teams = None if team is None else [tuple(renamed[rank] for rank in team)]
        key = (alike, teams and teams[0])
        if key not in measured:
            ranks = estimated_buffers([alike], teams, [(0,)], plan.num_ranks)
            memories = (step_memory(groups, plan.settings.overlap) for groups in set(map(tuple, ranks)))
            measured[key] = max(memory.peak for memory in memories)
        peaks.append(measured[key])
    if not peaks:
        return 0, -1
    index = max(range(len(peaks)), key=lambda i: (peaks[i], -i))
    return peaks[index], index


def over_budget(plan: Plan) -> str | None:
    """What to tell a user whose own memory budget ``plan`` cannot keep (``None``: it keeps it, or the
    budget is the default, which gives way to one matrix's needs and to speed silently)."""
    budget, target = plan.settings.memory_budget, plan.memory_target()
    if budget is None or not budget.strict or target is None or plan.teams is None:
        return None
    peak = max(memory.peak for memory in plan.rank_memory())
    if peak <= target:
        return None
    least, index = least_peak(plan)
    matrix = plan.matrices[index]
    fraction = peak / plan.matrix_bytes() if plan.matrix_bytes() else 0.0
    return (
        f"PlanConfig(memory_budget=...) allows {size_text(target)} of step buffers per rank "
        f"({budget.describe()}), but the plan holds {size_text(peak)} at its peak, the least its "
        f"micro-groups can: {matrix.name} (shape {matrix.shape}) alone needs {size_text(least)}. "
        f"Set memory_budget to {fraction:.2f} or more (or a size) for a budget the step keeps."
    )
