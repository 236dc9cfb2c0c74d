"""``canzona plan --sweep``: the balance target over Qwen3 presets × meshes, and the simulated
comparison at 256 GPUs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lightning_canzona.commands.analysis import Scenario, analyse
from lightning_canzona.commands.model_matrices import preset_matrices
from lightning_canzona.commands.tables import PAPER_ITERATION_SPEEDUP, PAPER_STEP_SPEEDUP
from lightning_canzona.planning.plan import PlanSettings, build_plan
from lightning_canzona.planning.report import report
from lightning_canzona.rules import MatrixRule

SWEEP_PRESETS: tuple[str, ...] = ("0.6B", "1.7B", "4B", "8B", "14B", "32B")
SWEEP_MESHES: tuple[tuple[int, int], ...] = ((8, 1), (32, 8), (64, 4), (256, 1))
SIMULATED_MESHES: tuple[tuple[int, int], ...] = ((32, 8), (256, 1))
#: ``canzona``'s makespan must stay within this factor of the lower bound.
TARGET = 1.02


def bound_table(
    rule: MatrixRule,
    settings: PlanSettings,
    presets: Sequence[str] = SWEEP_PRESETS,
    meshes: Sequence[tuple[int, int]] = SWEEP_MESHES,
) -> tuple[str, bool]:
    """Makespan / lower bound per preset, mesh and owner-based policy, and whether ``canzona``
    met `TARGET` everywhere."""
    policies = ("canzona", "lpt", "round_robin")
    lines = [f"{'preset':<7} {'dp×tp':>7} " + " ".join(f"{p:>12}" for p in policies) + "  target"]
    all_met = True
    for preset in presets:
        matrices, _ = preset_matrices(preset, rule)
        for dp, tp in meshes:
            ratios = [
                report(build_plan(matrices, dp, tp, replace(settings, policy=p))).makespan_over_bound
                for p in policies
            ]
            met = ratios[0] <= TARGET
            all_met &= met
            lines.append(
                f"{preset:<7} {f'{dp}×{tp}':>7} "
                + " ".join(f"{r:>12.4f}" for r in ratios)
                + f"  {'met' if met else 'MISSED'}"
            )
    return "\n".join(lines), all_met


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
