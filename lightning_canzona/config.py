"""The one configuration of how the optimizer step is planned and run: `PlanConfig`.

The strategy and the optimizers take the same object (``CanzonaStrategy(plan=...)``,
``Muon(params, plan=...)``, and the ``plan:`` key of either in a LightningCLI config). Where both
are given, they must agree (`bind_plan_config`): the strategy's applies to an optimizer that sets
none of its own, and two different ones are an error naming both, never a silent overwrite.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from lightning_canzona.planning import PlanSettings
from lightning_canzona.planning.memory import parse_budget
from lightning_canzona.planning.replication import REPLICATIONS, Replication

#: What the cost model charges for a team's collectives (see `PlanConfig.team_prices`).
TeamPrices = Literal["h100", "measure"] | tuple[float, float]


@dataclass(frozen=True)
class PlanConfig:
    """How each matrix update is assigned to ranks, batched and overlapped.

    Attributes:
        policy: Who computes each matrix update: ``canzona`` (α-balanced owners and
            micro-groups), ``lpt``, ``round_robin`` or ``sync`` (every rank, redundantly).
        alpha: ``canzona``'s balance between per-bucket uniformity (0) and global balance (1).
        cost: What the plan balances: ``flops`` of the updates or ``numel`` of the matrices.
        micro_group_capacity: Largest per-rank cost of one micro-group, in the cost's unit;
            ``None`` derives it from the model.
        max_team: Most ranks that compute one matrix's update together (``canzona``; a power of
            two, 1 keeps every matrix whole): the plan splits the costliest matrices over teams
            where the rule allows (Muon, Shampoo and SOAP: any 2-D matrix) and its cost model
            says it pays.
        team_prices: What the cost model charges for collectives: ``"h100"`` (H100s on NVLink
            within a node and InfiniBand across, in FLOPs of the rule's matrix products),
            ``"measure"`` (measured on the job's own devices and links when the first plan is
            built), or ``(FLOPs per element sent, FLOPs per collective)``.
        overlap: Pipeline the micro-groups: gather the next and scatter the previous group while
            the current one computes.
        replicas: Under HSDP (``data_parallel_replicate_size`` > 1): ``"replicated"`` plans each
            replica's matrices over its own shard × tensor-parallel ranks (every replica computes
            every update; the optimizer's traffic stays within a replica), ``"spread"`` computes
            each update once over every replica's ranks and sends it to all of them (less compute
            and matrix state per rank, traffic across replicas), ``"auto"`` the one whose
            estimated step is shorter at ``team_prices`` (`lightning_canzona.planning.replication`).
        memory_budget: The most bytes a step's buffers may hold at once on a rank, beside the
            optimizer state: ``"auto"`` (half the bytes of the matrices the rank holds, or what one
            matrix's update alone needs where that is more), a fraction of those bytes (``0.25``),
            a size (``"2GiB"``, ``"512MB"``), or ``None`` (no bound: micro-groups sized for speed
            alone). The plan cuts micro-groups to meet it (docs/memory.md).
    """

    policy: Literal["canzona", "lpt", "round_robin", "sync"] = "canzona"
    alpha: float = 0.5
    cost: Literal["flops", "numel"] = "flops"
    micro_group_capacity: float | None = None
    max_team: int = 8
    team_prices: TeamPrices = "h100"
    overlap: bool = True
    replicas: Replication = "auto"
    memory_budget: float | str | None = "auto"

    def __post_init__(self) -> None:
        self.settings()  # the planner's checks, each naming its setting
        if self.replicas not in REPLICATIONS:
            raise ValueError(f"replicas must be one of {REPLICATIONS}, got {self.replicas!r}")
        prices = self.team_prices
        figures = isinstance(prices, (tuple, list)) and len(prices) == 2
        if figures and all(isinstance(p, (int, float)) and p >= 0 for p in prices):
            # A list from a YAML file or the command line; the planner's figures are floats.
            object.__setattr__(self, "team_prices", (float(prices[0]), float(prices[1])))
        elif prices not in ("h100", "measure"):
            raise ValueError(
                "team_prices must be 'h100', 'measure' or (FLOPs per element sent, FLOPs per "
                f"collective) >= 0, got {prices!r}"
            )
        if not isinstance(self.overlap, bool):
            raise TypeError(f"overlap must be True or False, got {self.overlap!r}")

    def settings(self) -> PlanSettings:
        """The planner's settings (before the team prices are applied: `priced`)."""
        return PlanSettings(
            self.policy,
            self.alpha,
            self.cost,
            self.micro_group_capacity,
            max_team=self.max_team,
            memory_budget=parse_budget(self.memory_budget),
            overlap=self.overlap,
        )

    @staticmethod
    def given(plan: object) -> PlanConfig | None:
        """``plan`` as a strategy or an optimizer takes it: a `PlanConfig` or ``None``, else a
        `TypeError` naming the setting."""
        if plan is not None and not isinstance(plan, PlanConfig):
            raise TypeError(f"plan must be a lightning_canzona.PlanConfig or None, got {plan!r}")
        return plan

    def differences(self, other: PlanConfig) -> list[str]:
        """The names of the fields in which ``other`` differs."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
