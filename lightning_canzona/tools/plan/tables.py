"""What ``canzona plan`` prints: per-rank rows, the policy summary, the simulator's projections and
the HSDP choice (tables by `lightning_canzona.tools.tables.table`), and the lines around them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from lightning_canzona.planning import Plan, build_plan, report
from lightning_canzona.planning.devices import DeviceModel
from lightning_canzona.planning.plan import estimated_step
from lightning_canzona.planning.policies import MEMORY_STEP_TOLERANCE
from lightning_canzona.planning.replication import ReplicationChoice
from lightning_canzona.planning.report import COST_UNITS, least_peak
from lightning_canzona.tools.plan.analysis import PolicyResult, Scenario
from lightning_canzona.tools.simulation.iteration import Workload
from lightning_canzona.tools.simulation.traffic import traffic
from lightning_canzona.tools.tables import table

MIB = 2**20
#: The paper's reported speed-ups of Canzona over its baseline (arXiv 2602.06079, Qwen3 on 256 GPUs).
PAPER_STEP_SPEEDUP = 5.8
PAPER_ITERATION_SPEEDUP = 1.57


def shown_ranks(result: PolicyResult, limit: int) -> list[tuple[int, str]]:
    """Ranks to print with a label each: all of them up to ``limit``, otherwise the first rank
    and the ranks with the least, median and most load, the most state, the highest peak of the
    step's buffers and the most traffic."""
    loads = result.report.rank_loads
    num_ranks = len(loads)
    if num_ranks <= limit:
        return [(rank, "") for rank in range(num_ranks)]
    by_load = sorted(range(num_ranks), key=lambda r: (loads[r], r))
    state, peak = result.report.rank_state_bytes, result.report.rank_peak_bytes
    moved = result.traffic.rank_bytes
    picks = [
        (0, "first"),
        (by_load[0], "min load"),
        (by_load[num_ranks // 2], "median load"),
        (by_load[-1], "max load"),
        (max(range(num_ranks), key=lambda r: (state[r], -r)), "max state"),
        (max(range(num_ranks), key=lambda r: (peak[r], -r)), "max peak"),
        (max(range(num_ranks), key=lambda r: (moved[r], -r)), "max comm"),
    ]
    labels: dict[int, list[str]] = {}
    for rank, label in picks:
        labels.setdefault(rank, []).append(label)
    return [(rank, ", ".join(labels[rank])) for rank in sorted(labels)]


def rank_table(result: PolicyResult, limit: int = 16) -> str:
    """Per-rank load, matrices, optimizer state, step buffers at their peak and traffic (a
    selection on large meshes)."""
    rep, moved = result.report, result.traffic
    scale, unit = COST_UNITS[rep.cost]
    sent, received = moved.rank_sent, moved.rank_received
    shown = shown_ranks(result, limit)
    headers = ["rank", f"load [{unit}]", "matrices", "state [MiB]", "peak [MiB]", "sent [MiB]", "recv [MiB]"]
    text = table(
        [*headers, "note"],
        (
            [
                rank,
                f"{rep.rank_loads[rank] / scale:.3f}",
                rep.rank_matrices[rank],
                f"{rep.rank_state_bytes[rank] / MIB:.2f}",
                f"{rep.rank_peak_bytes[rank] / MIB:.2f}",
                f"{sent[rank] / MIB:.2f}",
                f"{received[rank] / MIB:.2f}",
                label,
            ]
            for rank, label in shown
        ),
        left=(len(headers),),
        margin=1,
    )
    if len(shown) < len(rep.rank_loads):
        text += f"\n({len(shown)} of {len(rep.rank_loads)} ranks shown)"
    return text


def summary_table(results: Mapping[str, PolicyResult]) -> str:
    """One row per policy: balance, bounds, micro-groups, largest state, peak of the step's buffers
    (and the two ratios of `PlanReport`) and traffic, the makespan averaged over the rule's
    decomposition period (where it has one), teams."""
    periodic = any(result.plan.period > 1 for result in results.values())
    headers = ["policy", "max/mean", "makespan/bound", "makespan/ideal", "grouped/bound", "groups"]
    headers += ["max state [MiB]", "max peak [MiB]", "peak/matrices", "(state+peak)/AdamW", "max comm [MiB]"]
    headers += [*(["average/ideal"] if periodic else []), "teams"]
    rows = []
    for policy, result in results.items():
        rep = result.report
        synced = rep.synchronized_makespan / rep.lower_bound if rep.lower_bound > 0 else 1.0
        rows.append(
            [
                policy,
                f"{rep.max_over_mean:.3f}",
                f"{rep.makespan_over_bound:.3f}",
                f"{rep.makespan_over_ideal:.3f}",
                f"{synced:.3f}",
                rep.num_micro_groups,
                f"{max(rep.rank_state_bytes) / MIB:.2f}",
                f"{max(rep.rank_peak_bytes, default=0) / MIB:.2f}",
                f"{rep.peak_over_matrix_bytes:.2f}",
                f"{rep.memory_over_adamw:.2f}",
                f"{max(result.traffic.rank_bytes) / MIB:.2f}",
                *([f"{rep.average_over_ideal:.3f}"] if periodic else []),
                ", ".join(f"{n} by {k}" for k, n in rep.split_matrices.items()) or "-",
            ]
        )
    return table(headers, rows, left=(0, len(headers) - 1))


def budget_line(result: PolicyResult) -> str:
    """Whether a policy's plan keeps its step buffers within the memory budget; where not, what
    bounds the cut: the largest one matrix's update alone (`report.least_peak`: below it no cut
    of the micro-groups helps) and, for the default budget, the estimated step it may cost."""
    rep, plan = result.report, result.plan
    policy, budget, target = plan.settings.policy, plan.settings.memory_budget, rep.memory_target
    peak = f"{policy}'s peak {rep.peak_over_matrix_bytes:.2f}×"
    if budget is None or target is None or not rep.matrix_bytes:
        return f"memory budget: none ({peak})"
    head = f"memory budget {target / rep.matrix_bytes:.2f}× the rank's matrix bytes ({target / MIB:.2f} MiB)"
    if max(rep.rank_peak_bytes) <= target:
        return f"{head}: met ({peak})"
    least, index = least_peak(plan)
    alone = f"{plan.matrices[index].name} alone needs {least / MIB:.2f} MiB ({least / rep.matrix_bytes:.2f}×)"
    if least > target:
        return f"{head} cannot be met: {alone}"
    growth = (
        ""
        if budget.strict
        else f"; the default cuts only while the estimated step grows ≤ {MEMORY_STEP_TOLERANCE:.0%}"
    )
    return f"{head}: missed ({peak}{growth}; {alone})"


def simulation_table(results: Mapping[str, PolicyResult]) -> str:
    """Projected step and iteration times per policy (where the rule decomposes periodically,
    averaged over the period, and the pipelined step that decomposes)."""
    periodic = any(result.step.period > 1 for result in results.values())
    headers = ["policy", "groups", "gather\n[ms]", "compute\n[ms]", "scatter\n[ms]", "step seq\n[ms]"]
    headers += ["step pipe\n[ms]", "iteration\n[s]", *(["decomposing\nstep [ms]"] if periodic else [])]
    rows = [
        [
            policy,
            len(step.gathers),
            f"{sum(step.gathers) * 1e3:.2f}",
            f"{step.compute * 1e3:.2f}",
            f"{sum(step.scatters) * 1e3:.2f}",
            f"{step.sequential * 1e3:.2f}",
            f"{step.pipelined * 1e3:.2f}",
            f"{result.iteration.total:.3f}",
            *([f"{step.peak_pipelined * 1e3:.2f}"] if periodic else []),
        ]
        for policy, result in results.items()
        for step in [result.step]
    ]
    text = table(headers, rows)
    if periodic:
        text += (
            f"\n(the rule decomposes every matrix's factors at once every "
            f"{max(r.step.period for r in results.values())} steps: times averaged over that period)"
        )
    return text


def speedups(results: Mapping[str, PolicyResult]) -> str:
    """Canzona's projected speed-ups next to the paper's."""
    canzona = results["canzona"]
    parts = []
    for baseline in ("sync", "round_robin"):
        if baseline in results:
            other = results[baseline]
            paper_step = f" (paper {PAPER_STEP_SPEEDUP}×)" if baseline == "sync" else ""
            paper_iter = f" (paper {PAPER_ITERATION_SPEEDUP}×)" if baseline == "sync" else ""
            parts.append(
                f"vs {baseline}: step {other.step.pipelined / canzona.step.pipelined:.2f}×{paper_step}, "
                f"iteration {other.iteration.total / canzona.iteration.total:.3f}×{paper_iter}"
            )
    return "canzona speed-up " + "; ".join(parts)


def assumptions(device: DeviceModel, workload: Workload, num_ranks: int, compute_dtype: str) -> str:
    """The simulator's assumptions in one paragraph."""
    link, bandwidth, latency = device.link(num_ranks)
    return (
        f"device {device.name}: {device.matmul_flops(compute_dtype) / 1e12:.0f} TFLOP/s effective "
        f"{compute_dtype} matmul ({device.achievable_fraction:.0%} of peak), collectives over {link} "
        f"at {bandwidth / 1e9:.0f} GB/s per GPU and {latency * 1e6:.0f} µs per message; "
        f"batch {workload.global_batch} × {workload.seq_len} tokens, forward+backward at "
        f"{workload.mfu:.0%} MFU, {workload.fsdp_overlap:.0%} of FSDP traffic overlapped"
    )


def locality_line(scenario: Scenario, canzona: PolicyResult) -> str:
    """What planning experts where they lie saves: canzona's traffic against the same plan made
    as if every matrix were fragmented (the paper's assumption)."""
    settings = replace(scenario.settings, policy="canzona", locality=False)
    blind_plan = build_plan(scenario.matrices, scenario.dp, scenario.tp, settings)
    aware, blind = canzona.traffic, traffic(blind_plan, scenario.element_bytes)
    held = sum(1 for matrix in scenario.matrices if matrix.holders)
    return (
        f"locality: {held} matrices lie whole on some rank (experts). canzona moves "
        f"{sum(aware.rank_sent) / MIB:,.1f} MiB per step (busiest rank {max(aware.rank_bytes) / MIB:,.1f}), "
        f"the same plan blind to locality {sum(blind.rank_sent) / MIB:,.1f} MiB "
        f"(busiest {max(blind.rank_bytes) / MIB:,.1f}): "
        f"{sum(blind.rank_sent) / max(1, sum(aware.rank_sent)):.1f}× less; max/mean load "
        f"{canzona.report.max_over_mean:.4f} vs {report(blind_plan).max_over_mean:.4f}"
    )


def replication_table(scenario: Scenario, choice: ReplicationChoice, plans: Mapping[str, Plan]) -> str:
    """HSDP: the plan replicated on each replica against the plan spread over all of them, by the
    planner's estimated step (what ``replicas="auto"`` compares) and the most state on a rank."""
    cost = scenario.settings.cost
    # The estimate is in FLOPs of the rule's matmuls: their time on the device model.
    scale, unit = (
        (scenario.device.matmul_flops(scenario.compute_dtype) / 1e3, "ms")
        if cost == "flops"
        else COST_UNITS[cost]
    )
    rows = [
        [
            mode,
            plan.num_ranks,
            scenario.device.link(plan.num_ranks)[0],
            f"{estimated_step(plan, choice.replicas if mode == 'spread' else 1) / scale:.3f}",
            f"{max(plan.rank_state_bytes()) / MIB:.1f}",
        ]
        for mode, plan in plans.items()
    ]
    headers = ["plan", "ranks", "exchanges over", f"est. step [{unit}]", "max state [MiB]"]
    chosen = f'replicas="auto" takes {choice.mode}: the shorter estimated step.'
    return table(headers, rows, left=(0, 2)) + "\n" + chosen
