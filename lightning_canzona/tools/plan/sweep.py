"""``canzona plan --sweep``: the balance target over Qwen3 presets × meshes up to 2,048 ranks,
with and without teams, the simulated comparison at 256 GPUs, and step time against ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from lightning_canzona.planning.bounds import team_bound
from lightning_canzona.planning.devices import DeviceModel
from lightning_canzona.planning.plan import PlanSettings, ideal_load
from lightning_canzona.planning.policies import build_plan
from lightning_canzona.planning.report import report
from lightning_canzona.planning.teams import TEAM_SIZES
from lightning_canzona.rules import MatrixRule
from lightning_canzona.tools.plan.analysis import Scenario, analyse
from lightning_canzona.tools.plan.model_matrices import (
    OPTIMIZERS,
    compute_dtype,
    make_rule,
    preset_matrices,
    rule_settings,
)
from lightning_canzona.tools.plan.tables import PAPER_ITERATION_SPEEDUP, PAPER_STEP_SPEEDUP
from lightning_canzona.tools.simulation.optimizer_step import project_step

SWEEP_PRESETS: tuple[str, ...] = ("0.6B", "1.7B", "4B", "8B", "14B", "32B")
SWEEP_MESHES: tuple[tuple[int, int], ...] = ((8, 1), (32, 8), (64, 4), (256, 1), (64, 8), (128, 8), (256, 8))
SIMULATED_MESHES: tuple[tuple[int, int], ...] = ((32, 8), (256, 1))
#: The preset of the scaling curves.
SCALE_PRESET = "32B"
#: Meshes of the scaling curves: nodes of 8 GPUs, 64 to 2,048 ranks.
SCALE_MESHES: tuple[tuple[int, int], ...] = ((8, 8), (16, 8), (32, 8), (64, 8), (128, 8), (256, 8))
#: ``canzona``'s makespan must stay within this factor of the lower bound (whole matrices) or of
#: the ideal (teams).
TARGET = 1.02


def bound_table(
    rule: MatrixRule,
    settings: PlanSettings,
    presets: Sequence[str] = SWEEP_PRESETS,
    meshes: Sequence[tuple[int, int]] = SWEEP_MESHES,
) -> tuple[str, bool]:
    """Per preset and mesh: whole-matrix plans' makespan ÷ lower bound (``canzona`` without
    teams, ``lpt``, ``round_robin``), and ``canzona``'s with teams ÷ the ideal ``total / ranks``
    (periodic work amortised, and averaged over its period: `Plan.average_makespan`),
    the team bound ÷ the ideal (what no plan with teams beats at these prices,
    `lightning_canzona.planning.bounds.team_bound`, and its average over the period,
    `plan.average_bound`), its teams and its per-rank state max/mean;
    and whether whole-matrix ``canzona`` met `TARGET` everywhere."""
    whole = replace(settings, max_team=1)
    lines = [
        f"{'preset':<7} {'dp×tp':>7} {'canzona':>8} {'lpt':>8} {'rr':>8}  {'target':<6} "
        f"{'teams ÷ ideal':>13} {'average':>8} {'bound ÷ ideal':>13} {'average':>8} "
        f"{'state max/mean':>14}  teams",
        f"{'':<7} {'':>7} {'(whole matrices ÷ lower bound)':>26}",
    ]
    all_met = True
    for preset in presets:
        matrices, _ = preset_matrices(preset, rule)
        for dp, tp in meshes:
            ratios = [
                report(build_plan(matrices, dp, tp, replace(whole, policy=p))).makespan_over_bound
                for p in ("canzona", "lpt", "round_robin")
            ]
            teamed = report(build_plan(matrices, dp, tp, settings))
            met = ratios[0] <= TARGET
            all_met &= met
            teams = ", ".join(f"{n}×{k}" for k, n in teamed.split_matrices.items()) or "-"
            lines.append(
                f"{preset:<7} {f'{dp}×{tp}':>7} "
                + " ".join(f"{r:>8.4f}" for r in ratios)
                + f"  {'met' if met else 'MISSED':<6} {teamed.makespan_over_ideal:>13.4f} "
                f"{teamed.average_over_ideal:>8.4f} "
                f"{teamed.team_bound / teamed.ideal:>13.4f} {teamed.average_bound / teamed.ideal:>8.4f} "
                f"{teamed.state_max_over_mean:>14.3f}  {teams}"
            )
    return "\n".join(lines), all_met


def team_bound_table(
    settings: PlanSettings,
    device: DeviceModel,
    presets: Sequence[str] = SWEEP_PRESETS,
    mesh: tuple[int, int] = SWEEP_MESHES[-1],
) -> str:
    """What keeps teams from the ideal on ``mesh``: per optimizer and preset, the team bound
    (`lightning_canzona.planning.bounds.team_bound`) ÷ the ideal with teams of up to the settings'
    ``max_team``, of up to the largest team size, and of that size with collectives free, at
    ``device``'s prices in each rule's FLOPs."""
    num_ranks = mesh[0] * mesh[1]
    lines = [
        f"{'optimizer':<9} {'preset':<7} {f'max_team {settings.max_team}':>11} "
        f"{f'max_team {TEAM_SIZES[-1]}':>11} {'and free collectives':>20}"
    ]
    for optimizer in OPTIMIZERS:
        rule = make_rule(optimizer)
        priced = rule_settings(settings, device, rule)
        largest = replace(priced, max_team=TEAM_SIZES[-1])
        variants = (priced, largest, replace(largest, flops_per_element=0.0, flops_per_message=0.0))
        for preset in presets:
            matrices, _ = preset_matrices(preset, rule)
            ideal = ideal_load(matrices, num_ranks, settings.cost)
            bounds = [team_bound(matrices, num_ranks, variant) / ideal for variant in variants]
            widths = (11, 11, 20)
            lines.append(
                f"{optimizer:<9} {preset:<7} " + " ".join(f"{b:>{w}.3f}" for b, w in zip(bounds, widths))
            )
    return "\n".join(lines)


def scale_curves(
    preset: str,
    device: DeviceModel,
    settings: PlanSettings,
    meshes: Sequence[tuple[int, int]] = SCALE_MESHES,
) -> dict[str, dict[str, list[float]]]:
    """Projected optimizer-step seconds of ``canzona`` with whole matrices and with teams, per
    optimizer, on each mesh."""
    curves: dict[str, dict[str, list[float]]] = {}
    for optimizer in OPTIMIZERS:
        rule = make_rule(optimizer)
        element_bytes = rule.exchange_dtype(torch.bfloat16).itemsize
        matrices, _ = preset_matrices(preset, rule)
        priced = rule_settings(settings, device, rule)
        for label, variant in (("whole matrices", replace(priced, max_team=1)), ("teams", priced)):
            curves.setdefault(optimizer, {})[label] = [
                project_step(
                    build_plan(matrices, dp, tp, variant), device, element_bytes, compute_dtype(rule)
                ).pipelined
                for dp, tp in meshes
            ]
    return curves


def scale_table(
    curves: dict[str, dict[str, list[float]]], meshes: Sequence[tuple[int, int]] = SCALE_MESHES
) -> str:
    """`scale_curves` as a table: milliseconds per step, and whole ÷ teams."""
    lines = [f"{'optimizer':<9} {'ranks':>6} {'whole [ms]':>11} {'teams [ms]':>11} {'whole ÷ teams':>14}"]
    for optimizer, curve in curves.items():
        for (dp, tp), whole, teams in zip(meshes, curve["whole matrices"], curve["teams"]):
            milliseconds = f"{whole * 1e3:>11.2f} {teams * 1e3:>11.2f}"
            lines.append(f"{optimizer:<9} {dp * tp:>6} {milliseconds} {whole / teams:>13.2f}×")
    return "\n".join(lines)


def simulation_comparison(
    base: Scenario,
    rule: MatrixRule,
    presets: Sequence[str] = SWEEP_PRESETS,
    meshes: Sequence[tuple[int, int]] = SIMULATED_MESHES,
) -> str:
    """Projected step and iteration times of ``sync``, ``round_robin`` and ``canzona`` side by side
    with the paper's speed-ups; ``base`` supplies everything but the model and the mesh."""
    policies = ("sync", "round_robin", "canzona")
    lines = [
        f"{'preset':<7} {'dp×tp':>7} {'step sync':>10} {'step rr':>9} {'step cz':>9} {'sync/cz':>9} "
        f"{'rr/cz':>7} {'iter sync':>10} {'iter rr':>9} {'iter cz':>9} {'sync/cz':>9} {'rr/cz':>7}",
        f"{'':<7} {'':>7} {'[ms]':>10} {'[ms]':>9} {'[ms]':>9} {f'(p {PAPER_STEP_SPEEDUP}×)':>9} "
        f"{'':>7} {'[s]':>10} {'[s]':>9} {'[s]':>9} {f'(p {PAPER_ITERATION_SPEEDUP}×)':>9} {'':>7}",
    ]
    for preset in presets:
        matrices, num_params = preset_matrices(preset, rule)
        for dp, tp in meshes:
            scenario = replace(base, matrices=matrices, num_params=num_params, dp=dp, tp=tp)
            results = analyse(scenario, policies)
            steps = [results[p].step.pipelined for p in policies]
            iterations = [results[p].iteration.total for p in policies]
            lines.append(
                f"{preset:<7} {f'{dp}×{tp}':>7} {steps[0] * 1e3:>10.1f} {steps[1] * 1e3:>9.2f} "
                f"{steps[2] * 1e3:>9.2f} {steps[0] / steps[2]:>8.1f}× {steps[1] / steps[2]:>6.2f}× "
                f"{iterations[0]:>10.3f} {iterations[1]:>9.3f} {iterations[2]:>9.3f} "
                f"{iterations[0] / iterations[2]:>8.3f}× {iterations[1] / iterations[2]:>6.3f}×"
            )
    return "\n".join(lines)
