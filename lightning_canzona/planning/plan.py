"""Plans: who updates which matrix, in which micro-group, under each policy.

Policies:

- ``sync``: every rank updates every matrix (the redundant baseline: ``torch.optim.Muon`` on
  DTensors behaves like this);
- ``round_robin``: owner ``i mod R`` in model order (the layer-wise baseline, blind to cost);
- ``lpt``: largest cost first onto the least-loaded rank, one global pass;
- ``canzona``: owners and micro-groups chosen together, α-balanced between per-bucket uniformity
  and global balance (see `micro_groups.balanced_groups`); kept only if its max/mean load beats
  round-robin's.

The baselines are cut into micro-groups in model order under the same capacity. Under FSDP2 × TP
every matrix is spread over the whole mesh, so any rank can own any matrix and the mesh is planned
as one set of ``dp·tp`` ranks. A plan is a pure function of the matrices, the mesh shape and the
settings: every rank builds the same plan alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_canzona.planning import partition
from lightning_canzona.planning.matrices import COST_KINDS, CostKind, MatrixSpec
from lightning_canzona.planning.micro_groups import balanced_groups, sequential_groups

POLICIES: tuple[str, ...] = ("canzona", "lpt", "round_robin", "sync")

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
            the model: 1.25 × half the mean per-rank load, at least the largest matrix.
        locality: ``canzona`` gives a matrix that some ranks hold whole to one of them (see
            `micro_groups.balanced_groups`); ``False`` plans as if every matrix were fragmented.
    """

    policy: str = "canzona"
    alpha: float = 0.5
    cost: CostKind = "flops"
    capacity: float | None = None
    locality: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cost not in COST_KINDS:
            raise ValueError(f"cost must be one of {COST_KINDS}, got {self.cost!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.capacity is not None and not self.capacity > 0:
            raise ValueError(f"micro_group_capacity must be > 0 or None, got {self.capacity}")


@dataclass(frozen=True)
class Plan:
    """The outcome of planning.

    Attributes:
        settings: The settings it was built with.
        matrices: The matrices, in model order.
        dp: Data-parallel size of the mesh.
        tp: Tensor-parallel size of the mesh; rank ``r = d·tp + t``.
        owners: Owner rank of each matrix; ``None`` under ``sync`` (every rank computes all).
        micro_groups: Matrix indices of each micro-group, in pipeline order.
        capacity: The capacity used.
        fell_back: ``canzona`` did not beat round-robin and took its owners.
    """

    settings: PlanSettings
    matrices: tuple[MatrixSpec, ...]
    dp: int
    tp: int
    owners: tuple[int, ...] | None
    micro_groups: tuple[tuple[int, ...], ...]
    capacity: float
    fell_back: bool = False
    loads: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loads", tuple(m.load(self.settings.cost) for m in self.matrices))

    @property
    def num_ranks(self) -> int:
        return self.dp * self.tp

    def rank_loads(self) -> list[float]:
        """Total cost each rank computes."""
        if self.owners is None:
            return [sum(self.loads)] * self.num_ranks
        totals = [0.0] * self.num_ranks
        for owner, load in zip(self.owners, self.loads):
            totals[owner] += load
        return totals

    def group_host_loads(self, group: tuple[int, ...]) -> list[float]:
        """Cost each rank computes within one micro-group."""
        if self.owners is None:
            return [sum(self.loads[i] for i in group)] * self.num_ranks
        totals = [0.0] * self.num_ranks
        for index in group:
            totals[self.owners[index]] += self.loads[index]
        return totals


def _capacity(settings: PlanSettings, loads: list[float], per_rank: float) -> float:
    largest = max(loads, default=0.0)
    if settings.capacity is not None:
        return settings.capacity
    # A quarter of slack lets first-fit packing fit each rank's share into GROUPS_PER_RANK groups
    # instead of spilling a sliver into one more group (and two more collectives).
    return max(largest, 1.25 * per_rank / GROUPS_PER_RANK, 1e-30)


def _max_over_mean(plan: Plan) -> float:
    totals = plan.rank_loads()
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0


def _fixed_owner_plan(settings, matrices, dp, tp, owners, capacity, fell_back=False) -> Plan:
    groups = sequential_groups(owners, [m.load(settings.cost) for m in matrices], capacity)
    return Plan(
        settings, tuple(matrices), dp, tp, tuple(owners), tuple(map(tuple, groups)), capacity, fell_back
    )


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
    buckets = [m.bucket for m in matrices]
    holders = [m.holders for m in matrices] if settings.locality else None
    groups, owners = balanced_groups(loads, buckets, num_ranks, settings.alpha, capacity, holders)
    plan = Plan(settings, tuple(matrices), dp, tp, tuple(owners), tuple(map(tuple, groups)), capacity)
    naive = _fixed_owner_plan(
        settings, matrices, dp, tp, partition.round_robin(loads, num_ranks), capacity, fell_back=True
    )
    return plan if _max_over_mean(plan) <= _max_over_mean(naive) else naive
