"""`refine`: swaps after packing lower the makespan, then the per-rank state, and raise nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_canzona.planning.policies as planner
from lightning_canzona.planning import MatrixSpec, Plan, PlanSettings, build_plan, report
from lightning_canzona.planning.devices import H100
from lightning_canzona.planning.refine import refine
from lightning_canzona.rules import ShampooRule
from lightning_canzona.rules.base import UpdateCost
from lightning_canzona.tools.plan.model_matrices import make_rule, preset_matrices, rule_settings


def _spec(index: int, rows: int, cols: int, bucket: int, holders: tuple[int, ...]) -> MatrixSpec:
    return MatrixSpec(
        f"layers.{bucket}.w{index}",
        (rows, cols),
        f"layers.{bucket}",
        ShampooRule().cost((rows, cols)),
        holders,
    )


matrix_lists = st.lists(
    st.tuples(
        st.integers(1, 300), st.integers(1, 300), st.integers(0, 3), st.sampled_from([(), (0,), (1, 2)])
    ),
    min_size=1,
    max_size=40,
).map(lambda rows: [_spec(i, r, c, b, h) for i, (r, c, b, h) in enumerate(rows)])


def _measures(p: Plan) -> dict[str, object]:
    loads = p.rank_loads()
    received = []
    for group in p.micro_groups:
        per_rank = [0.0] * p.num_ranks
        for index in group:
            for rank in p.teams[index]:
                per_rank[rank] += p.matrices[index].cost.numel / len(p.teams[index])
        received.append(max(per_rank))
    buckets: dict[str, list[float]] = {}
    for index, team in enumerate(p.teams):
        if not p.matrices[index].holders:
            for rank, load in zip(team, p.loads[index]):
                buckets.setdefault(p.matrices[index].bucket, [0.0] * p.num_ranks)[rank] += load
    return {
        "makespan": max(loads),
        "groups": [max(p.group_host_loads(group)) for group in p.micro_groups],
        "received": received,
        "buckets": {bucket: max(values) for bucket, values in buckets.items()},
        "sizes": [len(team) for team in p.teams],
    }


@settings(max_examples=150, deadline=None)
@given(
    matrices=matrix_lists,
    ranks=st.sampled_from([2, 3, 4, 8]),
    alpha=st.sampled_from([0.0, 0.5, 1.0]),
    capacity=st.sampled_from([None, 1e6, 1e7, 1e8]),  # many micro-groups, or few
)
def test_refine_raises_no_makespan_group_gather_or_bucket_and_keeps_held_matrices_on_holders(
    matrices, ranks, alpha, capacity
) -> None:
    packed = build_plan(matrices, ranks, 1, PlanSettings("lpt", alpha, capacity=capacity))  # not refined
    refined = refine(packed)
    before, after = _measures(packed), _measures(refined)
    tolerance = 1e-9 * max(before["makespan"], 1.0)
    assert after["makespan"] <= before["makespan"] + tolerance
    assert all(a <= b + tolerance for a, b in zip(after["groups"], before["groups"]))
    assert all(a <= b + 1e-9 for a, b in zip(after["received"], before["received"]))
    assert all(after["buckets"][bucket] <= limit + tolerance for bucket, limit in before["buckets"].items())
    assert after["sizes"] == before["sizes"] and refined.owners == tuple(team[0] for team in refined.teams)
    for index, (old, new) in enumerate(zip(packed.teams, refined.teams)):
        holders = matrices[index].holders
        assert new == old or not holders or new[0] in holders
    assert refine(packed) == refined  # deterministic
    # No plan, refined or not, beats the bound on the average over the decomposition period.
    bound = report(refined).average_bound
    assert bound <= min(packed.average_makespan(), refined.average_makespan()) * (1 + 1e-9)


@pytest.mark.parametrize(
    ("optimizer", "preset", "mesh", "makespan_before", "makespan_after", "state_before", "state_after"),
    [
        # A rank above the rest with a matrix that another can take: the makespan lowered.
        ("shampoo", "4B", (8, 1), 1.0108, 1.0034, 1.0067, 1.0057),
        # Ranks of equal load and unequal state (a matrix's factors grow with the square of its
        # sides, its FLOPs with their cube): state evened at the same makespan.
        ("soap", "4B", (32, 8), 1.3254, 1.3254, 1.1933, 1.0189),
    ],
)
def test_refine_on_qwen3(
    monkeypatch, optimizer, preset, mesh, makespan_before, makespan_after, state_before, state_after
) -> None:
    rule = make_rule(optimizer)
    matrices, _ = preset_matrices(preset, rule, *mesh)
    settings_ = rule_settings(PlanSettings(), H100, rule)
    refined = build_plan(matrices, *mesh, settings_)
    monkeypatch.setattr(planner, "refine", lambda packed: packed)
    packed = build_plan(matrices, *mesh, settings_)
    for p, makespan, state in (
        (packed, makespan_before, state_before),
        (refined, makespan_after, state_after),
    ):
        assert max(p.rank_loads()) / p.ideal == pytest.approx(makespan, abs=5e-4)
        assert report(p).state_max_over_mean == pytest.approx(state, abs=5e-4)


def test_refine_spreads_the_decompositions_that_crowd_a_rank() -> None:
    # Every rank costs 38 amortised, but rank 0 holds both matrices that decompose (10 FLOPs a
    # step, 90 more every 10th): its decomposition step costs 200, the other rank's steps 38.
    def matrix(name: str, steady: float, periodic: float) -> MatrixSpec:
        cost = UpdateCost(steady + periodic / 10, 100, 0, 0, period=10, periodic_flops=(periodic,))
        return MatrixSpec(name, (10, 10), "layers.0", cost)

    matrices = (matrix("a", 10, 90), matrix("b", 10, 90), matrix("c", 19, 0), matrix("d", 19, 0))
    plan = Plan(PlanSettings(), matrices, 2, 1, (0, 0, 1, 1), ((0, 1, 2, 3),), capacity=100.0)
    assert plan.average_makespan() == pytest.approx((9 * 38 + 200) / 10)
    refined = refine(plan)
    # One decomposing matrix per rank: steady steps of 29, decomposition steps of 119.
    assert sorted(refined.teams) == [(0,), (0,), (1,), (1,)] and refined.teams != plan.teams
    assert refined.rank_loads() == plan.rank_loads()
    assert refined.average_makespan() == pytest.approx((9 * 29 + 119) / 10)
