"""Everything ``canzona plan`` reports about one policy: plan, report, traffic and projections."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_canzona.planning.devices import DeviceModel
from lightning_canzona.planning.matrices import MatrixSpec
from lightning_canzona.planning.plan import POLICIES, Plan, PlanSettings
from lightning_canzona.planning.policies import build_plan
from lightning_canzona.planning.replication import ReplicationChoice, choose_replication, priced_for
from lightning_canzona.planning.report import PlanReport, report
from lightning_canzona.tools.simulation.iteration import IterationProjection, Workload, project_iteration
from lightning_canzona.tools.simulation.optimizer_step import StepProjection, project_step
from lightning_canzona.tools.simulation.traffic import Traffic, traffic


@dataclass(frozen=True)
class Scenario:
    """What is being planned and simulated.

    Attributes:
        matrices: The model's matrices under the chosen rule.
        num_params: The model's total parameter count.
        dp: Data-parallel size.
        tp: Tensor-parallel size.
        settings: α, cost and capacity (the policy is varied).
        element_bytes: Bytes per exchanged element.
        compute_dtype: Dtype of the rule's matmuls.
        device: GPU and links.
        workload: Batch and efficiency assumptions.
    """

    matrices: list[MatrixSpec]
    num_params: int
    dp: int
    tp: int
    settings: PlanSettings
    element_bytes: int
    compute_dtype: str
    device: DeviceModel
    workload: Workload


@dataclass(frozen=True)
class PolicyResult:
    """One policy's plan and what it costs."""

    plan: Plan
    report: PlanReport
    traffic: Traffic
    step: StepProjection
    iteration: IterationProjection


def analyse(scenario: Scenario, policies: tuple[str, ...] = POLICIES) -> dict[str, PolicyResult]:
    """Plan, measure and project every policy in ``policies``."""
    results = {}
    for policy in policies:
        plan = build_plan(
            scenario.matrices, scenario.dp, scenario.tp, replace(scenario.settings, policy=policy)
        )
        moved = traffic(plan, scenario.element_bytes)
        step = project_step(plan, scenario.device, scenario.element_bytes, scenario.compute_dtype, moved)
        results[policy] = PolicyResult(
            plan=plan,
            report=report(plan),
            traffic=moved,
            step=step,
            iteration=project_iteration(
                step, scenario.num_params, scenario.dp, scenario.tp, scenario.device, scenario.workload
            ),
        )
    return results


def compare_replication(
    scenario: Scenario, replicas: int, replica_matrices: list[MatrixSpec]
) -> tuple[ReplicationChoice, dict[str, Plan]]:
    """HSDP with ``replicas`` replicas among ``scenario``'s data-parallel ranks: canzona's plan
    replicated on each replica (of ``replica_matrices``, laid out on one replica's ranks) and
    spread over all of them, each priced over the links its ranks span (a node holds the device
    model's ``gpus_per_node``), and the one ``replicas="auto"`` takes.

    Spread, a matrix that a replica's ranks hold whole (an expert) is held by the same ranks of
    every replica: replica ``r``'s ranks follow the first's, ``r`` replicas' ranks later.
    """
    settings = replace(scenario.settings, policy="canzona")
    per_node, tp = scenario.device.gpus_per_node, scenario.tp
    shard = scenario.dp // replicas
    ranks = shard * tp  # a replica's
    spread_matrices = [
        replace(m, holders=tuple(r * ranks + h for r in range(replicas) for h in m.holders))
        for m in replica_matrices
    ]
    plans = {
        "replicated": build_plan(replica_matrices, shard, tp, priced_for(settings, ranks > per_node)),
        "spread": build_plan(
            spread_matrices, scenario.dp, tp, priced_for(settings, scenario.dp * tp > per_node)
        ),
    }
    return choose_replication("auto", replicas, plans["replicated"], plans["spread"]), plans
