"""``canzona plan``: the optimizer plan of a Qwen3 preset on a DP × TP mesh, for every policy.

Shapes come from the model built on the meta device, so even 32B plans in seconds without
weights. For each policy it prints per-rank load, matrices, optimizer state and traffic, then a
summary, a projection of step and iteration times on a modelled GPU cluster, and writes a PNG of
the per-rank loads. ``--replicate R`` (HSDP) compares the plan replicated on each of R replicas
with the plan spread over all of them. ``--sweep`` checks the balance target over all Qwen3 presets and meshes
instead, for every optimizer, up to 2,048 ranks, with and without teams, and draws step time
against ranks.

Example::

    canzona plan --preset 32B --dp 32 --tp 8 --device h100 --out plan.png
    canzona plan --preset 8B --optimizer soap --dp 2048 --replicate 256 --no-simulate
"""

from __future__ import annotations

import argparse

import torch

from lightning_canzona.commands import HelpFormatter, described, sweep, tables
from lightning_canzona.commands.analysis import Scenario, analyse, compare_replication
from lightning_canzona.commands.chart import write_load_chart, write_scale_chart
from lightning_canzona.commands.model_matrices import (
    OPTIMIZERS,
    compute_dtype,
    make_rule,
    preset_matrices,
    rule_settings,
)
from lightning_canzona.models.qwen3 import PRESETS
from lightning_canzona.planning.devices import DEVICES
from lightning_canzona.planning.matrices import COST_KINDS
from lightning_canzona.planning.plan import PlanSettings
from lightning_canzona.rules import MatrixRule
from lightning_canzona.simulation.iteration import Workload


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="canzona plan", description=described(__doc__), formatter_class=HelpFormatter
    )
    parser.add_argument("--preset", default="0.6B", choices=list(PRESETS), help="Qwen3 preset")
    parser.add_argument("--optimizer", default="muon", choices=OPTIMIZERS, help="the matrix rule")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel size")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="HSDP replicas among the --dp ranks (one per node, say): compare the optimizer's plan "
        "replicated on each replica with the plan spread over all of them",
    )
    parser.add_argument("--alpha", type=float, default=PlanSettings.alpha, help="canzona's α in [0, 1]")
    parser.add_argument("--cost", default="flops", choices=COST_KINDS, help="what the planner balances")
    parser.add_argument(
        "--max-team",
        type=int,
        default=PlanSettings.max_team,
        help="most ranks that compute one matrix together (1: whole matrices only)",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="parameter dtype"
    )
    parser.add_argument("--out", default="plan.png", help="PNG chart of per-rank loads")
    parser.add_argument("--ranks-shown", type=int, default=16, help="print every rank up to this mesh size")
    parser.add_argument(
        "--simulate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print projected step and iteration times",
    )
    parser.add_argument("--device", default="h100", choices=sorted(DEVICES), help="device model")
    parser.add_argument("--global-batch", type=int, default=Workload.global_batch, help="sequences")
    parser.add_argument("--seq-len", type=int, default=Workload.seq_len, help="tokens a sequence")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="check canzona's balance over Qwen3 0.6B–32B × meshes up to 2,048 ranks for every "
        "optimizer, with and without teams, compare the simulated policies at 256 GPUs and draw "
        "32B's step time against ranks to --scale-out (ignores --preset/--dp/--tp/--out)",
    )
    parser.add_argument("--scale-out", default="scale.png", help="--sweep's PNG of step time against ranks")
    return parser


def main(argv: list[str]) -> None:
    """Run ``canzona plan`` with the arguments after ``plan``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.replicate < 1 or args.dp % args.replicate:
        parser.error(f"--replicate {args.replicate} must be a positive divisor of --dp {args.dp}")
    rule = make_rule(args.optimizer)
    exchange = rule.exchange_dtype(getattr(torch, args.dtype))
    device = DEVICES[args.device]
    settings = PlanSettings(alpha=args.alpha, cost=args.cost, max_team=args.max_team)
    settings = rule_settings(settings, device, rule)  # the prices of what team_prices="h100" gives
    matrices, num_params = preset_matrices(args.preset, rule, args.dp, args.tp)
    scenario = Scenario(
        matrices=matrices,
        num_params=num_params,
        dp=args.dp,
        tp=args.tp,
        settings=settings,
        element_bytes=exchange.itemsize,
        compute_dtype=compute_dtype(rule),
        device=device,
        workload=Workload(global_batch=args.global_batch, seq_len=args.seq_len),
    )
    if args.sweep:
        _sweep(scenario, rule, args.scale_out)
        return

    results = analyse(scenario)
    num_ranks = args.dp * args.tp
    print(
        f"Qwen3 {args.preset}: {len(matrices)} matrices, {num_params / 1e9:.3f} B parameters; "
        f"{args.optimizer}, cost {args.cost}, α {args.alpha}; mesh dp {args.dp} × tp {args.tp} = "
        f"{num_ranks} ranks; exchange {str(exchange).removeprefix('torch.')} ({exchange.itemsize} B/element)"
    )
    for result in results.values():
        print(f"\n== {result.report.policy} ==")
        print(tables.rank_table(result, args.ranks_shown))
    print("\n== summary ==")
    print(tables.summary_table(results))
    print("grouped = synchronized makespan: Σ over micro-groups of the group's busiest host")
    if any(matrix.holders for matrix in matrices):
        print(tables.locality_line(scenario, results["canzona"]))
    if args.preset in sweep.SWEEP_PRESETS:
        canzona = results["canzona"].report
        if canzona.split_matrices:  # teams go below the whole matrices' bound: the ideal is theirs
            measure, value = "makespan/ideal", canzona.makespan_over_ideal
        else:
            measure, value = "makespan/bound", canzona.makespan_over_bound
        verdict = "met" if value <= sweep.TARGET else "MISSED"
        print(f"target: canzona {measure} {value:.4f} <= {sweep.TARGET}: {verdict}")
    if args.replicate > 1:
        shard = args.dp // args.replicate
        replica_matrices, _ = preset_matrices(args.preset, rule, shard, args.tp)
        choice, plans = compare_replication(scenario, args.replicate, replica_matrices)
        print(
            f"\n== HSDP: {args.replicate} replicas × shard {shard} × tp {args.tp}, "
            f"{device.gpus_per_node} GPUs per node =="
        )
        print(tables.replication_table(scenario, choice, plans))
    if args.simulate:
        print(f"\n== simulated on {num_ranks} × {scenario.device.name} ==")
        print(tables.simulation_table(results))
        print(tables.speedups(results))
        print(tables.assumptions(scenario.device, scenario.workload, num_ranks, scenario.compute_dtype))
    title = f"Qwen3 {args.preset}, {args.optimizer}, dp {args.dp} × tp {args.tp}: per-rank load"
    print(f"\nchart: {write_load_chart(args.out, results, title)}")


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
