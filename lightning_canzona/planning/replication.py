"""HSDP's replicas and the optimizer: plan each replica's matrices over its own ranks
(``replicated``) or once over all replicas (``spread``); `choose_replication` picks by estimated
step. docs/multinode.md#the-optimizer-under-hsdp-replicated-or-spread describes the trade."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from lightning_canzona.planning.plan import Plan, PlanSettings, estimated_step

Replication = Literal["auto", "replicated", "spread"]
REPLICATIONS: tuple[str, ...] = ("auto", "replicated", "spread")


def within_node(settings: PlanSettings) -> PlanSettings:
    """``settings`` with gathers and scatters priced as its teams' collectives (within a node)."""
    return replace(
        settings,
        exchange_flops_per_element=settings.flops_per_element,
        exchange_flops_per_message=settings.flops_per_message,
    )


def priced_for(settings: PlanSettings, spans_nodes: bool) -> PlanSettings:
    """``settings`` for a plan whose ranks span several nodes (as they are) or share one."""
    return settings if spans_nodes else within_node(settings)


@dataclass(frozen=True)
class ReplicationChoice:
    """How the optimizer's plan uses HSDP's replicas, and why.

    Attributes:
        setting: What the plan configuration asked for (`REPLICATIONS`).
        replicated_step: The replicated plan's estimated step (``None``: the setting chose).
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
    """The replication that ``setting`` asks for, or under ``auto`` the shorter estimated step
    (ties: ``replicated``); each plan priced over the links its ranks span (`priced_for`).
    ``replicated`` is needed unless ``setting`` is ``spread``, ``spread`` unless ``replicated``."""
    if setting not in REPLICATIONS:
        raise ValueError(f"replicas must be one of {REPLICATIONS}, got {setting!r}")
    if setting != "auto":
        return ReplicationChoice(setting, replicas, setting)  # type: ignore[arg-type]
    assert replicated is not None and spread is not None
    replicated_step, spread_step = estimated_step(replicated), estimated_step(spread, replicas)
    mode = "spread" if spread_step < replicated_step else "replicated"
    return ReplicationChoice(mode, replicas, setting, replicated_step, spread_step)
