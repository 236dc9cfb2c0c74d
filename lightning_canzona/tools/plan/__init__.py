"""``canzona plan``: the optimizer plan of a Qwen3 preset on a DP × TP mesh, for every policy,
without weights or GPUs (`plan`); its tables, charts, balance sweep and simulator are the modules
of this package.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Literal

import torch

from lightning_canzona.models.qwen3 import PRESETS
from lightning_canzona.planning.devices import DEVICES
from lightning_canzona.planning.matrices import COST_KINDS
from lightning_canzona.planning.plan import PlanSettings
from lightning_canzona.rules import MatrixRule
from lightning_canzona.tools.command import UsageError, run
from lightning_canzona.tools.plan import sweep, tables
from lightning_canzona.tools.plan.analysis import Scenario, analyse, compare_replication
from lightning_canzona.tools.plan.chart import write_load_chart, write_scale_chart
from lightning_canzona.tools.plan.model_matrices import (
    OPTIMIZERS,
    compute_dtype,
    make_rule,
    preset_matrices,
    rule_settings,
)
from lightning_canzona.tools.plan.sweep import SWEEP_PRESETS, TARGET
from lightning_canzona.tools.simulation.iteration import Workload

#: The names the command takes.
Preset = Literal[tuple(PRESETS)]
Optimizer = Literal[OPTIMIZERS]
Cost = Literal[COST_KINDS]
Device = Literal[tuple(sorted(DEVICES))]


def plan(
    preset: Preset = "0.6B",
    optimizer: Optimizer = "muon",
    dp: int = 8,
    tp: int = 1,
    replicate: int = 1,
    alpha: float = PlanSettings.alpha,
    cost: Cost = "flops",
    max_team: int = PlanSettings.max_team,
    dtype: Literal["bfloat16", "float32"] = "bfloat16",
    out: str = "plan.png",
    ranks_shown: int = 16,
    simulate: bool = True,
    device: Device = "h100",
    global_batch: int = Workload.global_batch,
    seq_len: int = Workload.seq_len,
    sweep: bool = False,
    scale_out: str = "scale.png",
) -> None:
    """The optimizer plan of a Qwen3 preset on a DP × TP mesh, for every policy.

    Shapes come from the model built on the meta device, so even 32B plans in seconds without
    weights. For each policy it prints per-rank load, matrices, optimizer state and traffic, then
    a summary, a projection of step and iteration times on a modelled GPU cluster, and writes a
    PNG of the per-rank loads. ``--replicate R`` (HSDP) compares the plan replicated on each of R
    replicas with the plan spread over all of them. ``--sweep`` checks the balance target over all
    Qwen3 presets and meshes instead, for every optimizer, up to 2,048 ranks, with and without
    teams, and draws step time against ranks.

    Example::

        canzona plan --preset 32B --dp 32 --tp 8 --device h100 --out plan.png
        canzona plan --preset 8B --optimizer soap --dp 2048 --replicate 256 --no-simulate

    Args:
        preset: Qwen3 preset
        optimizer: the matrix rule
        dp: data-parallel size
        tp: tensor-parallel size
        replicate: HSDP replicas among the --dp ranks (one per node, say): compare the
            optimizer's plan replicated on each replica with the plan spread over all of them
        alpha: canzona's α in [0, 1]
        cost: what the planner balances
        max_team: most ranks that compute one matrix together (1: whole matrices only)
        dtype: parameter dtype
        out: PNG chart of per-rank loads
        ranks_shown: print every rank up to this mesh size
        simulate: print projected step and iteration times
        device: device model
        global_batch: sequences
        seq_len: tokens a sequence
        sweep: check canzona's balance over Qwen3 0.6B–32B × meshes up to 2,048 ranks for every
            optimizer, with and without teams, compare the simulated policies at 256 GPUs and
            draw 32B's step time against ranks to --scale-out (ignores --preset/--dp/--tp/--out)
        scale_out: --sweep's PNG of step time against ranks

    Raises:
        UsageError: ``replicate`` is not a positive divisor of ``dp``.
    """
    if replicate < 1 or dp % replicate:
        raise UsageError(f"--replicate {replicate} must be a positive divisor of --dp {dp}")
    rule = make_rule(optimizer)
    exchange = rule.exchange_dtype(getattr(torch, dtype))
    gpu = DEVICES[device]
    settings = PlanSettings(alpha=alpha, cost=cost, max_team=max_team)
    settings = rule_settings(settings, gpu, rule)  # the prices of what team_prices="h100" gives
    matrices, num_params = preset_matrices(preset, rule, dp, tp)
    scenario = Scenario(
        matrices=matrices,
        num_params=num_params,
        dp=dp,
        tp=tp,
        settings=settings,
        element_bytes=exchange.itemsize,
        compute_dtype=compute_dtype(rule),
        device=gpu,
        workload=Workload(global_batch=global_batch, seq_len=seq_len),
    )
    if sweep:
        _sweep(scenario, rule, scale_out)
        return

    results = analyse(scenario)
    num_ranks = dp * tp
    print(
        f"Qwen3 {preset}: {len(matrices)} matrices, {num_params / 1e9:.3f} B parameters; "
        f"{optimizer}, cost {cost}, α {alpha}; mesh dp {dp} × tp {tp} = "
        f"{num_ranks} ranks; exchange {str(exchange).removeprefix('torch.')} ({exchange.itemsize} B/element)"
    )
    for result in results.values():
        print(f"\n== {result.report.policy} ==")
        print(tables.rank_table(result, ranks_shown))
    print("\n== summary ==")
    print(tables.summary_table(results))
    print("grouped = synchronized makespan: Σ over micro-groups of the group's busiest host")
    print(
        "peak = the step's buffers at their peak (memory model); peak/matrices: the busiest rank's ÷ "
        "the rank's matrix bytes; (state+peak)/AdamW: the most on a rank ÷ AdamW's two moments"
    )
    print(tables.budget_line(results["canzona"]))
    if any(matrix.holders for matrix in matrices):
        print(tables.locality_line(scenario, results["canzona"]))
    if preset in SWEEP_PRESETS:
        canzona = results["canzona"].report
        if canzona.split_matrices:  # teams go below the whole matrices' bound: the ideal is theirs
            measure, value = "makespan/ideal", canzona.makespan_over_ideal
        else:
            measure, value = "makespan/bound", canzona.makespan_over_bound
        verdict = "met" if value <= TARGET else "MISSED"
        print(f"target: canzona {measure} {value:.4f} <= {TARGET}: {verdict}")
    if replicate > 1:
        shard = dp // replicate
        replica_matrices, _ = preset_matrices(preset, rule, shard, tp)
        choice, plans = compare_replication(scenario, replicate, replica_matrices)
        print(
            f"\n== HSDP: {replicate} replicas × shard {shard} × tp {tp}, {gpu.gpus_per_node} GPUs per node =="
        )
        print(tables.replication_table(scenario, choice, plans))
    if simulate:
        print(f"\n== simulated on {num_ranks} × {scenario.device.name} ==")
        print(tables.simulation_table(results))
        print(tables.speedups(results))
        print(tables.assumptions(scenario.device, scenario.workload, num_ranks, scenario.compute_dtype))
    title = f"Qwen3 {preset}, {optimizer}, dp {dp} × tp {tp}: per-rank load"
    print(f"\nchart: {write_load_chart(out, results, title)}")


def _sweep(scenario: Scenario, rule: MatrixRule, scale_out: str) -> None:
    all_met = True
    for optimizer in OPTIMIZERS:
        each = make_rule(optimizer)
        table, met = sweep.bound_table(each, rule_settings(scenario.settings, scenario.device, each))
        all_met &= met
        print(
            f"== {optimizer}: canzona / lpt / round_robin (whole matrices) ÷ lower bound, target canzona "
            f"<= {sweep.TARGET}; canzona with teams ÷ ideal, and the team bound ÷ ideal =="
        )
        print(table)
        print()
    print(
        "whole-matrix target met on every preset and mesh"
        if all_met
        else "whole-matrix target MISSED on at least one (see above)"
    )
    dp, tp = sweep.SWEEP_MESHES[-1]
    print(f"\n== team bound ÷ ideal at dp {dp} × tp {tp}: what no plan with teams beats ==")
    print(sweep.team_bound_table(scenario.settings, scenario.device))
    print(f"\n== simulated on 256 × {scenario.device.name} (p = the paper's reported speed-up) ==")
    print(sweep.simulation_comparison(scenario, rule))
    print(tables.assumptions(scenario.device, scenario.workload, 256, scenario.compute_dtype))
    curves = sweep.scale_curves(sweep.SCALE_PRESET, scenario.device, scenario.settings)
    print(f"\n== Qwen3 {sweep.SCALE_PRESET}: simulated optimizer step against ranks (tp 8) ==")
    print(sweep.scale_table(curves))
    ranks = [dp * tp for dp, tp in sweep.SCALE_MESHES]
    title = f"Qwen3 {sweep.SCALE_PRESET} on {scenario.device.name}: projected optimizer step"
    print(f"chart: {write_scale_chart(scale_out, curves, ranks, title)}")


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``canzona plan`` with the arguments after ``plan``."""
    run(plan, sys.argv[1:] if argv is None else argv, prog="canzona plan")
