"""Planner properties, checked on random inputs (hypothesis) and on the real Qwen3 shapes."""

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_canzona.models import Qwen3
from lightning_canzona.optim import PRESETS, matrix_param_groups
from lightning_canzona.planning import (
    POLICIES,
    MatrixSpec,
    Plan,
    PlanSettings,
    block_of,
    build_plan,
    describe,
    report,
)
from lightning_canzona.planning.memory import parse_budget
from lightning_canzona.planning.report import least_peak
from lightning_canzona.rules import MuonRule, SOAPRule
from lightning_canzona.rules.base import UpdateCost


def _spec(index: int, rows: int, cols: int, bucket: int) -> MatrixSpec:
    return MatrixSpec(
        f"layers.{bucket}.w{index}",
        (rows, cols),
        f"layers.{bucket}",
        MuonRule(PRESETS["quintic"]).cost((rows, cols)),
    )


matrix_lists = st.lists(
    st.tuples(st.integers(1, 300), st.integers(1, 300), st.integers(0, 5)), min_size=1, max_size=40
).map(lambda rows: [_spec(i, r, c, b) for i, (r, c, b) in enumerate(rows)])
meshes = st.sampled_from([(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (3, 2), (8, 1), (4, 4)])
plan_settings = st.builds(
    PlanSettings,
    policy=st.sampled_from(POLICIES),
    alpha=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    cost=st.sampled_from(["flops", "numel"]),
    capacity=st.one_of(st.none(), st.floats(1.0, 1e9)),
)


@settings(max_examples=200, deadline=None)
@given(matrices=matrix_lists, mesh=meshes, plan_settings=plan_settings)
def test_every_matrix_is_owned_once_cost_is_conserved_and_capacity_holds(
    matrices, mesh, plan_settings
) -> None:
    dp, tp = mesh
    plan = build_plan(matrices, dp, tp, plan_settings)
    grouped = sorted(index for group in plan.micro_groups for index in group)
    assert grouped == list(range(len(matrices)))  # every matrix in exactly one micro-group
    if plan.owners is None:
        assert plan_settings.policy == "sync"
    else:
        assert len(plan.owners) == len(matrices) and all(0 <= o < dp * tp for o in plan.owners)
        assert sum(plan.rank_loads()) == pytest.approx(sum(map(sum, plan.loads)))  # cost conserved
    for group in plan.micro_groups:
        over = max(plan.group_host_loads(group)) > plan.capacity * (1 + 1e-12)
        assert not over or len(group) == 1, "only a single oversize matrix may pass the capacity"
    assert build_plan(list(matrices), dp, tp, plan_settings) == plan  # deterministic


@settings(max_examples=200, deadline=None)
@given(
    matrices=matrix_lists,
    mesh=meshes,
    alpha=st.sampled_from([0.0, 0.5, 1.0]),
    cost=st.sampled_from(["flops", "numel"]),
)
def test_canzona_is_never_worse_than_round_robin_by_max_over_mean(matrices, mesh, alpha, cost) -> None:
    canzona = report(build_plan(matrices, *mesh, PlanSettings("canzona", alpha, cost)))
    naive = report(build_plan(matrices, *mesh, PlanSettings("round_robin", alpha, cost)))
    assert canzona.max_over_mean <= naive.max_over_mean + 1e-12
    assert canzona.makespan >= canzona.lower_bound * (1 - 1e-12)


def test_the_chosen_cost_is_what_gets_balanced() -> None:
    # Two kinds of matrices with equal element counts but very different FLOPs (Muon's cost grows
    # with the smaller side cubed): balancing numel and balancing FLOPs give different plans.
    matrices = [_spec(i, 64, 4096, i) for i in range(4)] + [_spec(4 + i, 512, 512, 4 + i) for i in range(4)]
    by_flops = build_plan(matrices, 2, 1, PlanSettings("canzona", alpha=1.0, cost="flops"))
    by_numel = build_plan(matrices, 2, 1, PlanSettings("canzona", alpha=1.0, cost="numel"))
    assert report(by_flops).max_over_mean < 1.01 and report(by_numel).max_over_mean < 1.01
    assert report(by_flops).cost == "flops" and report(by_numel).cost == "numel"
    assert by_numel.loads != by_flops.loads  # each plan measured its own cost


def test_alpha_zero_spreads_every_bucket_and_alpha_one_balances_totals() -> None:
    # Bucket 0 holds four equal matrices, bucket 1 one large one: α = 0 gives each of two ranks
    # half of bucket 0; α = 1 gives the large matrix a rank of its own side of the balance.
    matrices = [_spec(i, 100, 100, 0) for i in range(4)] + [_spec(4, 200, 200, 1)]
    uniform = build_plan(matrices, 2, 1, PlanSettings("canzona", alpha=0.0, cost="numel"))
    assert sorted(uniform.owners[:4]) == [0, 0, 1, 1]
    balanced = build_plan(matrices, 2, 1, PlanSettings("canzona", alpha=1.0, cost="numel"))
    assert report(balanced).max_over_mean == pytest.approx(1.0)


def test_none_of_the_plan_depends_on_gradients_or_ranks() -> None:
    matrices = [_spec(i, 64 + 7 * i, 96, i % 3) for i in range(12)]
    plans = {build_plan(matrices, 2, 2, PlanSettings()) for _ in range(3)}
    assert len(plans) == 1


@pytest.mark.parametrize("preset", ["0.6B", "4B", "32B"])
@pytest.mark.parametrize("mesh", [(8, 1), (32, 8), (256, 1)])
def test_canzona_reaches_the_lower_bound_on_qwen3_shapes(preset, mesh) -> None:
    with torch.device("meta"):
        model = Qwen3(preset)
    named = [(name, p.shape) for name, p in matrix_param_groups(model)[0]["params"]]
    matrices = describe(named, MuonRule(PRESETS["quintic"]))
    canzona = report(build_plan(matrices, *mesh, PlanSettings("canzona")))
    assert canzona.makespan_over_bound <= 1.02
    if preset == "32B" and mesh == (256, 1):
        assert report(build_plan(matrices, *mesh, PlanSettings("round_robin"))).makespan_over_bound > 1.3


def test_report_accounts_state_on_owners_only() -> None:
    rule = SOAPRule()
    matrices = describe([("layers.0.a.weight", (64, 32)), ("layers.1.b.weight", (32, 64))], rule)
    plan = build_plan(matrices, 2, 1, PlanSettings("round_robin"))
    summary = report(plan)
    assert summary.rank_state_bytes == [m.cost.matrix_state_bytes for m in matrices]
    assert sum(report(build_plan(matrices, 2, 1, PlanSettings("sync"))).rank_state_bytes) == 2 * sum(
        m.cost.matrix_state_bytes for m in matrices
    )
    assert "max/mean" in summary.table() and summary.num_micro_groups >= 1


def test_the_report_shows_the_memory_models_figures_and_a_budget_lowers_them() -> None:
    with torch.device("meta"):
        model = Qwen3("small")
    named = [(name, p.shape) for name, p in matrix_param_groups(model)[0]["params"]]
    matrices = describe(named, MuonRule(PRESETS["quintic"]))
    plan = build_plan(matrices, 4, 1)
    summary = report(plan)
    assert summary.rank_peak_bytes == [memory.peak for memory in plan.rank_memory()]
    assert (summary.matrix_bytes, summary.memory_target) == (plan.matrix_bytes(), plan.memory_target())
    adamw = 2 * sum(m.cost.numel * m.param_bytes for m in matrices) / 4  # two moments, per rank
    held = max(state + peak for state, peak in zip(plan.rank_state_bytes(), summary.rank_peak_bytes))
    assert summary.memory_over_adamw == pytest.approx(held / adamw)
    assert summary.peak_over_matrix_bytes == pytest.approx(max(summary.rank_peak_bytes) / plan.matrix_bytes())
    lines = summary.table().splitlines()
    assert "state [MiB]  peak [MiB]" in lines[0]
    assert f"({summary.peak_over_matrix_bytes:.2f}× the rank's matrix bytes, budget 0.50×)" in lines[-1]
    # A tighter budget cuts the micro-groups: the peak never grows.
    cut = report(build_plan(matrices, 4, 1, PlanSettings(memory_budget=parse_budget(0.25))))
    assert cut.num_micro_groups > summary.num_micro_groups
    assert max(cut.rank_peak_bytes) <= max(summary.rank_peak_bytes)
    assert cut.budget_over_matrix_bytes == pytest.approx(0.25)


def test_the_least_peak_is_the_busiest_ranks_peak_with_one_matrix_alone() -> None:
    rule = MuonRule(PRESETS["quintic"])
    matrices = describe([(f"layers.{i}.w", (64 * (i + 1), 96)) for i in range(3)], rule)
    matrices[1] = replace(matrices[1], holders=(2, 3))  # held by 2 and 3, computed by 3
    teams = ((2, 3), (3,), (0,))
    owned = Plan(PlanSettings(), tuple(matrices), 2, 2, (2, 3, 0), ((0, 1, 2),), 1e30, teams=teams)
    synced = Plan(PlanSettings("sync"), tuple(matrices), 2, 2, None, ((0, 1, 2),), 1e30)
    for plan in (owned, synced):
        alone = [
            replace(plan, matrices=(matrix,), owners=plan.owners and (plan.owners[i],), micro_groups=((0,),))
            for i, matrix in enumerate(matrices)
        ]
        if plan.teams is not None:
            alone = [replace(each, teams=(team,)) for each, team in zip(alone, plan.teams)]
        peaks = [max(memory.peak for memory in each.rank_memory()) for each in alone]
        assert least_peak(plan) == (max(peaks), peaks.index(max(peaks)))
        assert least_peak(plan)[0] <= max(memory.peak for memory in plan.rank_memory())


def _periodic(name: str, steady: float, periodic: float) -> MatrixSpec:
    """A matrix of ``steady`` FLOPs per step and ``periodic`` more every 10th step."""
    cost = UpdateCost(steady + periodic / 10, 100, 0, 0, period=10, periodic_flops=(periodic,))
    return MatrixSpec(name, (10, 10), "layers.0", cost)


def test_the_average_makespan_pays_the_decomposition_step_on_the_busiest_rank() -> None:
    # Amortised, both ranks cost 19 per step; rank 0 decomposes 90 FLOPs every 10th step.
    matrices = (_periodic("layers.0.a", 10, 90), _periodic("layers.0.b", 19, 0))
    plan = Plan(PlanSettings(), matrices, 2, 1, owners=(0, 1), micro_groups=((0, 1),), capacity=100.0)
    assert plan.period == 10 and plan.rank_loads() == [19.0, 19.0] and plan.rank_peaks() == [100.0, 19.0]
    assert plan.steady == ((10.0,), (19.0,))
    summary = report(plan)
    assert (summary.makespan, summary.peak_makespan) == (19.0, 100.0)
    # Nine steps wait for rank 1 (19), the tenth for rank 0 (100).
    assert summary.average_makespan == pytest.approx((9 * 19 + 100) / 10)
    assert summary.average_over_ideal == pytest.approx(27.1 / 19)
    # No placement does better: the decomposing matrix alone is 100 on its step.
    assert summary.average_bound == pytest.approx(summary.average_makespan)
    line = "decompositions every 10 steps: those steps' makespan/ideal 5.263, the average step's 1.426"
    assert f"{line} (its bound 1.426)" in summary.table()
    muon = build_plan([_spec(i, 30 + i, 20, 0) for i in range(5)], 2, 1)  # no periodic work: all alike
    assert muon.period == 1 and muon.average_makespan() == max(muon.rank_loads()) == max(muon.rank_peaks())


def test_buckets_are_transformer_blocks() -> None:
    assert block_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert block_of("lm_head.weight") == "lm_head"
    assert block_of("weight") == "weight"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "greedy"}, "policy must be one of"),
        ({"alpha": 1.5}, r"alpha must lie in \[0, 1\]"),
        ({"cost": "time"}, "cost must be one of"),
        ({"capacity": 0.0}, "micro_group_capacity must be > 0"),
    ],
)
def test_bad_settings_are_named(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        PlanSettings(**kwargs)


def test_locality_owns_each_held_matrix_on_a_holder_balanced_and_moves_no_bytes() -> None:
    from dataclasses import replace

    from lightning_canzona.tools.simulation.traffic import traffic

    # 2 MoE layers of 16 experts that FSDP2 left whole, two per rank (Shard(0): experts 2r, 2r + 1
    # on rank r), around dense attention
    # matrices fragmented over all 8 ranks.
    matrices = []
    for layer in range(2):
        matrices += [_spec(len(matrices), 64, 64, layer) for _ in range(4)]
        matrices += [replace(_spec(len(matrices), 96, 64, layer), holders=(e // 2,)) for e in range(16)]
    local, blind = (build_plan(matrices, 8, 1, PlanSettings(locality=flag)) for flag in (True, False))
    for index, matrix in enumerate(matrices):
        if matrix.holders:
            assert local.owners[index] in matrix.holders
    assert report(local).max_over_mean <= 1.05
    expert_bytes = [
        sum(traffic(plan, 2).gathers[g].sent[r] for g in range(len(plan.micro_groups)) for r in range(8))
        for plan in (local, blind)
    ]
    dense_only = build_plan([m for m in matrices if not m.holders], 8, 1)
    dense_bytes = sum(traffic(dense_only, 2).rank_sent) // 2  # gathers only
    assert expert_bytes[0] == dense_bytes  # the experts add nothing
    assert expert_bytes[1] > 2 * dense_bytes  # blind: most experts travel to another rank and back


def test_hsdp_replicas_are_planned_by_the_shorter_estimated_step() -> None:
    """Under HSDP, ``replicas="auto"`` replicates the plan on each replica where its estimated
    step is shorter (Muon on a small model: each update travels over a node's links only) and
    spreads it over the replicas where that is (SOAP: its float32 compute, divided by the
    replicas, outweighs sending each update to both over InfiniBand); spreading sends every
    replica its update, which costs the scatter; a given setting is taken as it is."""
    from lightning_canzona.planning.devices import H100
    from lightning_canzona.planning.plan import estimated_step
    from lightning_canzona.planning.replication import choose_replication, within_node
    from lightning_canzona.tools.plan.model_matrices import make_rule, preset_matrices, rule_settings

    replicas, shard = 2, 8
    modes = {}
    for optimizer in ("muon", "soap"):
        rule = make_rule(optimizer)
        settings = rule_settings(PlanSettings(), H100, rule)
        replicated = build_plan(preset_matrices("0.6B", rule, shard)[0], shard, 1, within_node(settings))
        spread = build_plan(preset_matrices("0.6B", rule, replicas * shard)[0], replicas * shard, 1, settings)
        assert estimated_step(spread, replicas) > estimated_step(spread)
        choice = choose_replication("auto", replicas, replicated, spread)
        modes[optimizer] = choice.mode
        assert choice.replicated_step == estimated_step(replicated)
        assert choice.spread_step == estimated_step(spread, replicas)
        assert "replicas='auto' takes the shorter" in choice.describe(spread.num_ranks)
    assert modes == {"muon": "replicated", "soap": "spread"}
    assert choose_replication("spread", replicas, None, None).mode == "spread"
    with pytest.raises(ValueError, match="replicas must be one of"):
        choose_replication("everywhere", replicas, None, None)
