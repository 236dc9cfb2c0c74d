"""``canzona plan --sweep``: the balance target over Qwen3 presets × meshes up to 2,048 ranks,
with and without teams, the simulated comparison at 256 GPUs, and step time against ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from lightning_canzona.planning.bounds import team_bound
from lightning_canzona.planning.devices import DeviceModel
from lightning_canzona.planning.matrices import TEAM_SIZES
from lightning_canzona.planning.plan import PlanSettings, ideal_load
from lightning_canzona.planning.policies import build_plan
from lightning_canzona.planning.report import report
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
from lightning_canzona.tools.tables import table

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
    rows = []
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
            rows.append(
                [
                    preset,
                    f"{dp}×{tp}",
                    *(f"{ratio:.4f}" for ratio in ratios),
                    "met" if met else "MISSED",
                    f"{teamed.makespan_over_ideal:.4f}",
                    f"{teamed.average_over_ideal:.4f}",
                    f"{teamed.team_bound / teamed.ideal:.4f}",
                    f"{teamed.average_bound / teamed.ideal:.4f}",
                    f"{teamed.state_max_over_mean:.3f}",
                    ", ".join(f"{n}×{k}" for k, n in teamed.split_matrices.items()) or "-",
                ]
            )
    headers = ["preset", "dp×tp", "canzona", "lpt", "rr", "target", "teams ÷ ideal", "average"]
    headers += ["bound ÷ ideal", "average", "state max/mean", "teams"]
    return table(headers, rows, left=(0, 5, 11)), all_met


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
    rows = []
    for optimizer in OPTIMIZERS:
        rule = make_rule(optimizer)
        priced = rule_settings(settings, device, rule)
        largest = replace(priced, max_team=TEAM_SIZES[-1])
        variants = (priced, largest, replace(largest, flops_per_element=0.0, flops_per_message=0.0))
        for preset in presets:
            matrices, _ = preset_matrices(preset, rule)
            ideal = ideal_load(matrices, num_ranks, settings.cost)
            bounds = [team_bound(matrices, num_ranks, variant) / ideal for variant in variants]
            rows.append([optimizer, preset, *(f"{bound:.3f}" for bound in bounds)])
    headers = ["optimizer", "preset", f"max_team {settings.max_team}", f"max_team {TEAM_SIZES[-1]}"]
    return table([*headers, "and free collectives"], rows, left=(0, 1))


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
    rows = [
        [optimizer, dp * tp, f"{whole * 1e3:.2f}", f"{teams * 1e3:.2f}", f"{whole / teams:.2f}×"]
        for optimizer, curve in curves.items()
        for (dp, tp), whole, teams in zip(meshes, curve["whole matrices"], curve["teams"])
    ]
    return table(["optimizer", "ranks", "whole [ms]", "teams [ms]", "whole ÷ teams"], rows)


def simulation_comparison(
    base: Scenario,
    rule: MatrixRule,
    presets: Sequence[str] = SWEEP_PRESETS,
    meshes: Sequence[tuple[int, int]] = SIMULATED_MESHES,
) -> str:
    """Projected step and iteration times of ``sync``, ``round_robin`` and ``canzona`` side by side
    with the paper's speed-ups; ``base`` supplies everything but the model and the mesh."""
    policies = ("sync", "round_robin", "canzona")
    rows = []
    for preset in presets:
        matrices, num_params = preset_matrices(preset, rule)
        for dp, tp in meshes:
            scenario = replace(base, matrices=matrices, num_params=num_params, dp=dp, tp=tp)
            results = analyse(scenario, policies)
            steps = [results[p].step.pipelined for p in policies]
            iterations = [results[p].iteration.total for p in policies]
            rows.append(
                [
                    preset,
                    f"{dp}×{tp}",
                    f"{steps[0] * 1e3:.1f}",
                    f"{steps[1] * 1e3:.2f}",
                    f"{steps[2] * 1e3:.2f}",
                    f"{steps[0] / steps[2]:.1f}×",
                    f"{steps[1] / steps[2]:.2f}×",
                    f"{iterations[0]:.3f}",
                    f"{iterations[1]:.3f}",
                    f"{iterations[2]:.3f}",
                    f"{iterations[0] / iterations[2]:.3f}×",
                    f"{iterations[1] / iterations[2]:.3f}×",
                ]
            )
    headers = ["preset", "dp×tp", "step sync\n[ms]", "step rr\n[ms]", "step cz\n[ms]"]
    headers += [f"sync/cz\n(p {PAPER_STEP_SPEEDUP}×)", "rr/cz", "iter sync\n[s]", "iter rr\n[s]"]
    headers += ["iter cz\n[s]", f"sync/cz\n(p {PAPER_ITERATION_SPEEDUP}×)", "rr/cz"]
    return table(headers, rows)
