"""HSDP's replicas and the optimizer: plan each replica's matrices over its own ranks, or spread
them over all replicas.

Under HSDP every replica holds the same weights and, once FSDP2 has all-reduced them, the same
gradients. The optimizer can then

- **replicate** the plan: each replica computes every update over its own shard × TP ranks (as
  HSDP's AdamW steps every replica's shards); the gathers and scatters stay within a replica —
  within a node where a replica is one — and each replica holds all matrix state; or
- **spread** it: each matrix is computed once over all ranks of all replicas and its update is
  sent to every replica; the compute and the matrix state are divided by the replicas, but the
  gathers and scatters cross nodes and each update travels once per replica.

`choose_replication` picks the one whose estimated step (`plan.estimated_step`) is shorter, each
priced over the links it crosses; ties go to the replicated plan, which keeps the traffic off the
slower links.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from lightning_canzona.planning.plan import Plan, PlanSettings, estimated_step

Replication = Literal["auto", "replicated", "spread"]
REPLICATIONS: tuple[str, ...] = ("auto", "replicated", "spread")


def within_node(settings: PlanSettings) -> PlanSettings:
    """``settings`` whose gathers and scatters are priced as its teams' collectives: a plan whose
    ranks share a node's links (NVLink) rather than cross nodes (InfiniBand)."""
    return replace(
        settings,
        exchange_flops_per_element=settings.flops_per_element,
        exchange_flops_per_message=settings.flops_per_message,
    )


def priced_for(settings: PlanSettings, spans_nodes: bool) -> PlanSettings:
    """``settings`` for a plan whose ranks span several nodes (as they are: gathers and scatters
    at the exchange prices) or share one (`within_node`)."""
    return settings if spans_nodes else within_node(settings)


@dataclass(frozen=True)
class ReplicationChoice:
    """How the optimizer's plan uses HSDP's replicas, and why.

    Attributes:
        mode: ``replicated`` (each replica plans over its own ranks) or ``spread`` (one plan over
            every replica's ranks).
        replicas: The number of replicas.
        setting: What the plan configuration asked for (`REPLICATIONS`).
        replicated_step: The replicated plan's estimated step in the cost's unit (``None``: not
            planned, the setting chose).
        spread_step: The spread plan's, likewise.
    """

    mode: Literal["replicated", "spread"]
    replicas: int
    setting: str
    replicated_step: float | None = None
    spread_step: float | None = None

    def describe(self, plan_ranks: int) -> str:
        """One line for the report of the plan chosen, which has ``plan_ranks`` ranks."""
        if self.mode == "replicated":
            line = (
                f"HSDP: the plan is replicated: each of the {self.replicas} replicas computes every "
                f"update over its own {plan_ranks} ranks"
            )
        else:
            line = (
                f"HSDP: the plan spreads over all {self.replicas} replicas: each update is computed "
                f"once over {plan_ranks} ranks and sent to every replica"
            )
        if self.replicated_step is None or self.spread_step is None:
            return f"{line} (replicas={self.setting!r})."
        ratio = self.spread_step / self.replicated_step if self.replicated_step > 0 else 1.0
        return (
            f"{line}: the spread plan's estimated step is {ratio:.2f}× the replicated one's "
            "(replicas='auto' takes the shorter)."
        )


def choose_replication(
    setting: str, replicas: int, replicated: Plan | None, spread: Plan | None
) -> ReplicationChoice:
    """The replication that ``setting`` asks for, or under ``auto`` the plan with the shorter
    estimated step (ties: ``replicated``).

    Args:
        setting: ``auto``, ``replicated`` or ``spread``.
        replicas: The number of replicas.
        replicated: The plan of one replica's matrices over its ranks, its exchanges priced over
            the links a replica spans (`within_node` where it fits a node); needed unless
            ``setting`` is ``spread``.
        spread: The plan over every replica's ranks, priced over the links the whole mesh spans;
            needed unless ``setting`` is ``replicated``.
    """
    if setting not in REPLICATIONS:
        raise ValueError(f"replicas must be one of {REPLICATIONS}, got {setting!r}")
    if setting != "auto":
        return ReplicationChoice(setting, replicas, setting)  # type: ignore[arg-type]
    assert replicated is not None and spread is not None
    replicated_step, spread_step = estimated_step(replicated), estimated_step(spread, replicas)
    mode = "spread" if spread_step < replicated_step else "replicated"
    return ReplicationChoice(mode, replicas, setting, replicated_step, spread_step)
