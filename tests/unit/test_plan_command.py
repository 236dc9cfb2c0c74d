"""``canzona plan``, the traffic model and the simulator, on small presets and hand-worked cases."""

import random
import re
from dataclasses import replace

import pytest

from lightning_canzona.cli import main
from lightning_canzona.planning import POLICIES, PlanSettings, build_plan, describe, report
from lightning_canzona.planning.plan import estimated_step
from lightning_canzona.planning.replication import choose_replication, within_node
from lightning_canzona.planning.report import least_peak
from lightning_canzona.rules import MuonRule
from lightning_canzona.rules.newton_schulz import PRESETS
from lightning_canzona.tools.plan.analysis import Scenario, analyse
from lightning_canzona.tools.plan.model_matrices import (
    compute_dtype,
    make_rule,
    preset_matrices,
    rule_settings,
)
from lightning_canzona.tools.plan.sweep import bound_table
from lightning_canzona.tools.simulation import H100, Workload, pipelined_time, project_step, sequential_time
from lightning_canzona.tools.simulation.traffic import traffic

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plan_output(capsys, tmp_path, *args: str) -> tuple[str, bytes]:
    png = tmp_path / "plan.png"
    main(["plan", *args, "--out", str(png)])
    return capsys.readouterr().out, png.read_bytes()


def _summary_row(out: str, policy: str) -> list[str]:
    summary = out.split("== summary ==")[1]
    return next(line.split() for line in summary.splitlines() if line.startswith(policy + " "))


def test_plan_prints_every_policy_consistent_with_the_report_and_writes_a_png(capsys, tmp_path) -> None:
    out, png = _plan_output(capsys, tmp_path, "--preset", "tiny", "--dp", "2", "--tp", "2")
    assert png.startswith(PNG_MAGIC)
    matrices, _ = preset_matrices("tiny", make_rule("muon"))
    for policy in POLICIES:
        assert f"== {policy}" in out
        rep = report(build_plan(matrices, 2, 2, PlanSettings(policy)))
        row = _summary_row(out, policy)
        assert row[1:5] == [
            f"{rep.max_over_mean:.3f}",
            f"{rep.makespan_over_bound:.3f}",
            f"{rep.makespan_over_ideal:.3f}",
            f"{rep.synchronized_makespan / rep.lower_bound:.3f}",
        ]
        assert int(row[5]) == rep.num_micro_groups
        assert row[7:10] == [
            f"{max(rep.rank_peak_bytes) / 2**20:.2f}",
            f"{rep.peak_over_matrix_bytes:.2f}",
            f"{rep.memory_over_adamw:.2f}",
        ]
    plan = build_plan(matrices, 2, 2, PlanSettings("canzona"))
    canzona = report(plan)
    table = out.split("== canzona ==")[1].split("==")[0]
    rows = [line.split() for line in table.splitlines() if re.match(r"\s+\d+\s", line)]
    loads = [load / 1e9 for load in canzona.rank_loads]
    assert [float(row[1]) for row in rows] == pytest.approx(loads, abs=1e-3)
    assert [row[4] for row in rows] == [f"{memory.peak / 2**20:.2f}" for memory in plan.rank_memory()]
    # One matrix's update alone needs more than the default budget: the command says which.
    least, index = least_peak(plan)
    assert least > plan.memory_target()
    alone = f"{plan.matrices[index].name} alone needs {least / 2**20:.2f} MiB"
    assert "memory budget 0.50× the rank's matrix bytes" in out and f"cannot be met: {alone}" in out
    assert "simulated on 4 × H100 SXM" in out and "paper 5.8×" in out


def test_large_meshes_print_a_labelled_selection_of_ranks(capsys, tmp_path) -> None:
    out, png = _plan_output(capsys, tmp_path, "--preset", "0.6B", "--dp", "32", "--tp", "8", "--no-simulate")
    assert png.startswith(PNG_MAGIC)
    assert "of 256 ranks shown" in out and "max load" in out and "simulated" not in out
    # Teams sum in float32 (twice bf16's bytes): at H100 prices none pays for 0.6B at 256 ranks,
    # so the target is the whole-matrix bound, met.
    assert "target: canzona makespan/bound 1.0000 <= 1.02: met" in out
    matrices, _ = preset_matrices("0.6B", make_rule("muon"))
    rep = report(build_plan(matrices, 32, 8, PlanSettings("round_robin")))
    table = out.split("== round_robin ==")[1].split("==")[0]
    max_row = next(line for line in table.splitlines() if "max load" in line)
    assert float(max_row.split()[1]) == pytest.approx(rep.makespan / 1e9, abs=1e-3)


def test_float32_soap_exchanges_four_bytes_per_element_and_numel_cost_is_used(capsys, tmp_path) -> None:
    out, _ = _plan_output(
        capsys, tmp_path, "--preset", "small", "--optimizer", "soap", "--dtype", "float32", "--cost", "numel"
    )
    assert "exchange float32 (4 B/element)" in out and "load [M elements]" in out
    assert "float32 matmul" in out


def test_shampoo_plans_print_the_step_that_decomposes_and_hsdp_its_replication(capsys, tmp_path) -> None:
    out, _ = _plan_output(
        capsys,
        tmp_path,
        "--preset",
        "tiny",
        "--optimizer",
        "shampoo",
        "--dp",
        "2",
        "--tp",
        "2",
        "--replicate",
        "2",
    )
    rule = make_rule("shampoo")
    matrices, _ = preset_matrices("tiny", rule)
    assert "average/ideal" in _summary_header(out) and "decomposing" in out
    for policy in POLICIES:
        plan = build_plan(matrices, 2, 2, rule_settings(PlanSettings(policy), H100, rule))
        assert _summary_row(out, policy)[11] == f"{report(plan).average_over_ideal:.3f}"
    assert "every matrix's factors at once every 10 steps" in out
    # HSDP, 2 replicas of tp 2: each replica's plan over 2 ranks, or one over 4; one node's links.
    within = within_node(rule_settings(PlanSettings(), H100, rule))
    plans = {
        "replicated": build_plan(preset_matrices("tiny", rule, 1, 2)[0], 1, 2, within),
        "spread": build_plan(matrices, 2, 2, within),
    }
    table = out.split("== HSDP: 2 replicas × shard 1 × tp 2, 8 GPUs per node ==")[1].splitlines()
    per_ms = H100.matmul_flops("float32") / 1e3
    for mode, plan in plans.items():
        step = estimated_step(plan, 2 if mode == "spread" else 1)
        assert next(line for line in table if line.startswith(mode)).split()[1:4] == [
            str(plan.num_ranks),
            "NVLink",
            f"{step / per_ms:.3f}",
        ]
    choice = choose_replication("auto", 2, plans["replicated"], plans["spread"])
    assert f'replicas="auto" takes {choice.mode}' in out


def _summary_header(out: str) -> str:
    return out.split("== summary ==")[1].splitlines()[1]


def _two_matrices():
    # A: 4×6 = 24 elements (shards 12 + 12), B: 3×3 = 9 elements (shards 5 + 4).
    return describe(
        [("layers.0.a.weight", (4, 6)), ("layers.1.b.weight", (3, 3))], MuonRule(PRESETS["quintic"])
    )


def test_traffic_of_a_hand_worked_two_rank_example() -> None:
    one_group = PlanSettings("round_robin", capacity=1e30)  # owners: A → rank 0, B → rank 1
    owned = traffic(build_plan(_two_matrices(), 2, 1, one_group), element_bytes=2)
    (gather,), (scatter,) = owned.gathers, owned.scatters
    # Rank 0 sends its 5-element shard of B and receives rank 1's 12 elements of A; rank 1 mirrors.
    assert gather.sent == [10, 24] and gather.received == [24, 10]
    assert scatter.sent == [24, 10] and scatter.received == [10, 24]
    assert owned.rank_bytes == [68, 68]

    synced = traffic(build_plan(_two_matrices(), 2, 1, replace(one_group, policy="sync")), element_bytes=2)
    # Every rank receives the 33 − own elements and sends its own (17 or 16) to the other rank.
    assert synced.gathers[0].sent == [34, 32] and synced.gathers[0].received == [32, 34]
    assert synced.scatters[0].sent == [0, 0]


@pytest.mark.parametrize("mesh", [(3, 2), (4, 1), (2, 1)])
def test_traffic_balances_and_sync_moves_at_least_as_much(mesh) -> None:
    matrices, _ = preset_matrices("small", make_rule("muon"))
    moved = {p: traffic(build_plan(matrices, *mesh, PlanSettings(p)), element_bytes=2) for p in POLICIES}
    for policy, result in moved.items():
        assert sum(result.rank_sent) == sum(result.rank_received), policy
    for policy in ("canzona", "lpt", "round_robin"):
        assert sum(moved["sync"].rank_bytes) >= sum(moved[policy].rank_bytes)
        assert all(s >= o for s, o in zip(moved["sync"].rank_received, moved[policy].rank_received))


def test_pipeline_overlaps_a_hand_worked_schedule_and_never_loses() -> None:
    # G0 [0,1], C0 [1,3], G1 [1,2], S0 [3,4], C1 [3,5], S1 [5,6].
    assert pipelined_time([1, 1], [2, 2], [1, 1]) == 6 and sequential_time([1, 1], [2, 2], [1, 1]) == 8
    rng = random.Random(0)
    for _ in range(200):
        count = rng.randint(1, 6)
        parts = [[rng.random() for _ in range(count)] for _ in range(3)]
        assert pipelined_time(*parts) <= sequential_time(*parts) + 1e-12
        assert pipelined_time(*parts) >= max(sum(parts[1]), sum(parts[0]) + sum(parts[2])) - 1e-12


def _scenario(preset: str, dp: int, tp: int, device=H100) -> Scenario:
    rule = make_rule("muon")
    matrices, num_params = preset_matrices(preset, rule)
    return Scenario(matrices, num_params, dp, tp, PlanSettings(), 2, compute_dtype(rule), device, Workload())


def test_canzona_beats_round_robin_and_sync_on_32b_at_256_ranks() -> None:
    results = analyse(_scenario("32B", 32, 8), ("sync", "round_robin", "canzona"))
    canzona, naive, synced = (results[p] for p in ("canzona", "round_robin", "sync"))
    assert canzona.step.pipelined <= naive.step.pipelined < synced.step.pipelined
    assert canzona.iteration.total <= naive.iteration.total < synced.iteration.total
    assert canzona.step.link == "InfiniBand"
    for result in results.values():
        assert result.step.pipelined <= result.step.sequential


def test_more_bandwidth_or_flops_is_never_slower() -> None:
    base = _scenario("0.6B", 8, 2)
    faster = [
        replace(H100, inter_node_bandwidth=2 * H100.inter_node_bandwidth),
        replace(H100, inter_node_latency=0.0),
        replace(H100, achievable_fraction=1.0),
    ]
    for policy in ("sync", "round_robin", "canzona"):
        plan = build_plan(base.matrices, 8, 2, PlanSettings(policy))
        slow = project_step(plan, H100, 2, "bfloat16")
        for device in faster:
            assert project_step(plan, device, 2, "bfloat16").pipelined <= slow.pipelined
    assert project_step(build_plan(base.matrices, 8, 1), H100, 2, "bfloat16").link == "NVLink"


def test_the_projected_step_averages_the_decomposition_step_over_its_period() -> None:
    rule = make_rule("shampoo")
    matrices, _ = preset_matrices("0.6B", rule)
    step = project_step(build_plan(matrices, 4, 2), H100, 4, compute_dtype(rule))
    assert step.period == rule.precondition_frequency == 10
    assert all(peak > steady for peak, steady in zip(step.peak_computes, step.computes))
    steady = pipelined_time(step.gathers, step.computes, step.scatters)
    assert step.pipelined == pytest.approx((9 * steady + step.peak_pipelined) / 10)
    assert steady < step.pipelined < step.peak_pipelined
    muon = _scenario("0.6B", 4, 2)
    plain = project_step(build_plan(muon.matrices, 4, 2), H100, 2, "bfloat16")
    assert (plain.period, plain.peak_computes, plain.peak_pipelined) == (1, (), plain.pipelined)


def test_the_balance_target_holds_on_a_small_sweep() -> None:
    table, met = bound_table(make_rule("muon"), PlanSettings(), presets=("0.6B",), meshes=((8, 1), (64, 4)))
    assert met and table.count("met") == 2


def test_a_mixture_of_experts_preset_is_planned_expert_by_expert_where_experts_lie(capsys, tmp_path) -> None:
    # The real shapes' planning at scale is the 32B test's; here the tiny mixture's 4 blocks ×
    # (4 attention matrices + 2 stacks × 8 experts).
    out, _ = _plan_output(capsys, tmp_path, "--preset", "tiny-moe", "--dp", "8", "--tp", "2", "--no-simulate")
    assert "Qwen3 tiny-moe: 80 matrices" in out
    saved = re.search(r"locality: 64 matrices lie whole on some rank .* ([\d.]+)× less", out)
    assert saved is not None and float(saved.group(1)) > 5  # measured 6.6


@pytest.mark.parametrize(
    "command, default",
    [
        (["plan"], "Qwen3 preset (default: 0.6B)"),
        (["bench"], "{train,ns,step,qk-clip}"),
        (["bench", "step"], "timed steps per variant (default: 10)"),
        (["bench", "ns"], "matrix shapes (default: 256x256 512x512"),
        (["doctor"], "--quick"),
    ],
)
def test_a_commands_help_is_plain_text_with_its_defaults(capsys, command, default) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    printed = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    assert exited.value.code == 0 and default in printed
    assert "``" not in printed and "(default: None)" not in printed, printed
