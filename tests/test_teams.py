"""Teams: several ranks compute one matrix's update together, exactly.

The algebra is checked in one process (each member's computation run in lockstep, their
requests combined by hand); the engine on gloo ranks, against the single-process optimizer on
the full matrices, with the planner made to use teams; the planner in pure logic.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from multiprocess import run_on_ranks
from test_engine_exactness import MESHES, OPTIMIZERS, _run_combination
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import lightning_canzona as lc
from lightning_canzona.commands.model_matrices import make_rule, preset_matrices
from lightning_canzona.distributed import engine as engine_module
from lightning_canzona.distributed.prices import measure_team_costs, priced
from lightning_canzona.distributed.team_collectives import joined_state, member_state
from lightning_canzona.geometry import long_dim, member_blocks, split_sizes
from lightning_canzona.optim.optimizer import DTYPES
from lightning_canzona.planning import PlanSettings, build_plan, describe, policies, report
from lightning_canzona.planning.bounds import team_bound
from lightning_canzona.planning.matrices import MatrixSpec
from lightning_canzona.planning.micro_groups import balanced_groups, least_busy_block
from lightning_canzona.planning.plan import estimated_step
from lightning_canzona.planning.policies import STATE_BALANCE, STEP_TOLERANCE, team_plan
from lightning_canzona.planning.team_search import (
    greedy_makespan,
    overflow_sizes,
    searched_sizes,
    sizes_of,
    team_sizes,
)
from lightning_canzona.planning.teams import TEAM_SIZES, candidate_teams, local_members
from lightning_canzona.rules.base import TeamSum, UpdateCost
from lightning_canzona.rules.blocks import RowBlockRule
from lightning_canzona.rules.muon import MuonRule
from lightning_canzona.rules.newton_schulz import (
    FORMS,
    PRESETS,
    newton_schulz,
    splits_polynomial,
    team_newton_schulz,
    team_work,
)
from lightning_canzona.rules.shampoo import ShampooRule
from lightning_canzona.rules.soap import SOAPRule
from lightning_canzona.simulation import H100, project_step

#: Collectives cost nothing: the planner splits every matrix whose split lowers the bound.
FREE_TEAMS = {
    "flops_per_element": 0.0,
    "flops_per_message": 0.0,
    "exchange_flops_per_element": 0.0,
    "exchange_flops_per_message": 0.0,
}


def _slices(full: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [
        full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        for offset, shape in member_blocks(full.shape, size)
    ]


def _in_lockstep(runs: list, shape) -> torch.Tensor:
    """Every member's team computation, rounds combined here, the members' results joined."""
    rounds: list = [None] * len(runs)
    results: list = [None] * len(runs)

    def advance(member: int, reply) -> None:
        try:
            rounds[member] = runs[member].send(reply)
        except StopIteration as done:
            results[member] = done.value

    for member in range(len(runs)):
        advance(member, None)
    while any(result is None for result in results):
        reply = tuple(
            sum(r.tensor for r in requests)
            if isinstance(requests[0], TeamSum)
            else torch.cat([r.tensor for r in requests], dim=-2)
            for requests in zip(*rounds)
        )
        for member in range(len(runs)):
            advance(member, reply)
    return torch.cat(results, dim=long_dim(shape))


def _newton_schulz_in_lockstep(full: torch.Tensor, size: int, form: str) -> torch.Tensor:
    args = (PRESETS["quintic"], 5, 1e-7, torch.float32)
    runs = [
        team_newton_schulz(part, full.shape, *args, member, size, form)
        for member, part in enumerate(_slices(full, size))
    ]
    return _in_lockstep(runs, full.shape)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(6, 50), (50, 6), (33, 33), (3, 7, 20)])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_team_newton_schulz_equals_one_rank(shape, size, form) -> None:
    # (33, 33) over 3 or 4 members splits the polynomial's rows; (6, 50) does not.
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(size))
    expected = newton_schulz(matrix, PRESETS["quintic"], 5, 1e-7, torch.float32, form)
    torch.testing.assert_close(_newton_schulz_in_lockstep(matrix, size, form), expected, rtol=1e-5, atol=1e-5)


KRONECKER_RULES = {
    "shampoo": ShampooRule(precondition_frequency=2, start_preconditioning_step=2, max_precond_dim=8),
    "soap": SOAPRule(precondition_frequency=2, max_precond_dim=8),
}


@pytest.mark.parametrize(
    ("rule_name", "shape"),
    [
        (name, shape)
        for name in sorted(KRONECKER_RULES)
        for shape in [(6, 50), (50, 6), (13, 10), (7, 5), (5, 8), (7, 7)]
    ],
)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_kronecker_team_updates_equal_one_rank(rule_name, shape, size) -> None:
    # (13, 10) has no factor at max_precond_dim 8: the members' computations are their own
    # (SOAP: no round at all; Shampoo: its grafting norms). (7, 5), (5, 8) and (7, 7) have factors
    # on both sides (the long side's in rows, the gradient and momentum gathered; SOAP's basis
    # whole on every member, its refresh reordering the members' rows of the second moment). Five
    # steps: decompositions at 1 (SOAP), 2 and 4, refreshes at 2 and 4 (SOAP).
    rule = KRONECKER_RULES[rule_name]
    assert rule.team_cost(shape, size) is not None
    whole = rule.init_matrix_state(torch.Size(shape), torch.device("cpu"))
    members = [rule.init_team_state(shape, m, size, torch.device("cpu")) for m in range(size)]
    generator = torch.Generator().manual_seed(size)
    for _ in range(5):
        # Small integers: the factor's sum over slices is exact in any order.
        grad = torch.randint(-3, 4, shape, generator=generator).float()
        expected = rule.direction(grad, whole)
        runs = [
            rule.team_direction(part, shape, m, size, members[m])
            for m, part in enumerate(_slices(grad, size))
        ]
        # Relative in norm: a wide matrix's team rotates its transposed slices (other ulps, which
        # SOAP's Adam ratio grows where a rotated entry is near zero: 2e-6 measured, 3e-8 tall).
        error = torch.linalg.vector_norm(_in_lockstep(runs, shape) - expected)
        assert error <= 1e-5 * torch.linalg.vector_norm(expected)
    # The members' state joined is the one-rank state.
    joined = joined_state(members, rule.team_sliced_keys(shape), shape)
    assert joined.keys() == whole.keys()
    for key, value in whole.items():
        torch.testing.assert_close(joined[key], value, rtol=1e-5, atol=1e-6, msg=key)
        member = member_state(joined, rule.team_sliced_keys(shape), shape, 1, size)[key]
        assert member.shape == members[1][key].shape, key


def test_kronecker_team_costs_count_the_members_work_and_what_they_send() -> None:
    shampoo, soap = ShampooRule(max_precond_dim=64), SOAPRule(max_precond_dim=64, precondition_frequency=4)
    assert shampoo.team_cost((3, 130, 40), 2) is None  # a stack
    assert shampoo.team_cost((130, 40), 131) is None  # more members than rows
    cost = soap.team_cost((130, 40), 4)
    whole = soap.cost((130, 40))
    # A quarter of the rows (rounded up): 4 products of 2·40·33·40; the short side's whole
    # decomposition on the last member only.
    assert cost.flops == 4 * 2 * 40 * 33 * 40 + 10 * 33 * 40
    assert cost.member_flops == (0.0, 0.0, 0.0, 10 * 40**3 / 4)
    # On a step that decomposes, the last member pays the whole decomposition; on others, none.
    assert (cost.period, cost.periodic_flops) == (4, (0.0, 0.0, 0.0, 10 * 40**3))
    assert cost.step_flops_of(3, periodic=True) == cost.flops + 10 * 40**3
    assert cost.step_flops_of(3, periodic=False) == cost.step_flops_of(0, periodic=True) == cost.flops
    assert whole.step_flops_of(0, periodic=True) - whole.step_flops_of(0, periodic=False) == 10 * 40**3
    assert cost.busiest_flops < whole.flops and cost.numel == 33 * 40
    assert (cost.team_messages, soap.team_cost((130, 70), 4).team_messages) == (1, 0)
    assert shampoo.team_cost((130, 40), 4).team_messages == 2
    assert cost.matrix_state_bytes == 4 * (2 * 33 * 40 + 2 * 40 * 40)
    # The factor summed (a ring sends 2·3/4 of it), its basis shared every 4th step, two norms.
    assert cost.team_numel == round(1.5 * 40 * 40 + 1.5 * 40 * 40 / 4) + 2
    # Both sides, SOAP: the factor's rows, its basis whole; three matrices gathered per step.
    soap_two_sided = soap.team_cost((64, 48), 4)
    assert soap_two_sided.matrix_state_bytes == 4 * (2 * 16 * 48 + 2 * 48 * 48 + 16 * 64 + 64 * 64)
    assert (soap_two_sided.team_messages, soap.cost((64, 48)).flops > 2 * soap_two_sided.busiest_flops) == (
        3,
        True,
    )
    # Both sides (Shampoo): a member's 16 rows of 64 × 48; the long side's root on member 0,
    # the short side's on the last;
    # the gradient and momentum gathered whole (each member sends its 16 × 48 to 3 others), the
    # factor's and the root's rows before a decomposition (every 10th step).
    two_sided = shampoo.team_cost((64, 48), 4)
    assert two_sided.flops == 2 * 2 * (48 + 64) * 16 * 48 + 10 * 16 * 48
    assert two_sided.member_flops == (10 * 64**3 / 10, 0.0, 0.0, 10 * 48**3 / 10)
    assert shampoo.team_cost((64, 48), 2).member_flops == (10 * 64**3 / 10, 10 * 48**3 / 10)
    assert two_sided.matrix_state_bytes == 4 * (2 * 16 * 48 + 2 * 48 * 48 + 2 * 16 * 64)
    shared = 1.5 * (48 * 48 + 64 * 64) / 10
    assert two_sided.team_numel == round(shared + 1.5 * 48 * 48 + 3 * (2 * 16 * 48 + 2 * 16 * 64 / 10)) + 2
    assert two_sided.busiest_flops < shampoo.cost((64, 48)).flops / 2


def test_team_work_counts_what_the_team_computation_does() -> None:
    # Split polynomial (2·33·3 > 33): one gather per step besides the sums; FLOPs per member.
    work = team_work(33, 33, 5, "standard", 4)
    assert splits_polynomial(33, 33, 4) and work.collectives == 1 + 5 + 5
    assert work.flops == 5 * (4 * 33 * 33 * 9 + 2 * 33 * 33 * 9)
    assert not splits_polynomial(64, 1024, 4) and team_work(64, 1024, 5, "standard", 4).collectives == 6
    assert team_work(64, 1024, 5, "gram", 4).collectives == 3  # the first sums, one restart
    # A float32 Gram matrix travels with the norm: one collective fewer.
    assert team_work(64, 1024, 5, "standard", 4, norm_apart=False).collectives == 5
    assert team_work(64, 1024, 5, "gram", 4, norm_apart=False).collectives == 2
    rule = MuonRule(PRESETS["quintic"])
    assert rule.team_cost((64, 1024), 4).team_messages == 6
    assert dataclasses.replace(rule, compute_dtype=torch.float32).team_cost((64, 1024), 4).team_messages == 5
    rounds = 0
    run = team_newton_schulz(
        torch.randn(64, 256), (64, 1024), PRESETS["quintic"], 5, 1e-7, torch.float32, 0, 4, "gram"
    )
    try:
        request = next(run)
        while True:
            rounds += 1
            request = run.send(tuple(r.tensor for r in request))
    except StopIteration:
        pass
    assert rounds == 2


def test_split_sizes_member_blocks_and_aligned_teams() -> None:
    assert split_sizes(7, 3) == (3, 2, 2)
    assert member_blocks((130, 70), 4) == [
        ((0, 0), (33, 70)),
        ((33, 0), (33, 70)),
        ((66, 0), (32, 70)),
        ((98, 0), (32, 70)),
    ]
    assert member_blocks((70, 130), 2) == [((0, 0), (70, 65)), ((0, 65), (70, 65))]
    assert candidate_teams(6, 4) == ((0, 1, 2, 3),)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 1.0, 2.5, 4.0, 7.0]), min_size=16, max_size=16),
    st.sampled_from([2, 4, 8]),
    st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=8, max_size=8),
)
def test_least_busy_block_is_the_exhaustive_choice(rank_loads, size, member_loads) -> None:
    # Loads drawn from few values, so that ties (first block wins) occur often.
    blocks = candidate_teams(len(rank_loads), size)
    maxima = [max(rank_loads[rank] for rank in block) for block in blocks]
    minima = [min(rank_loads[rank] for rank in block) for block in blocks]
    for load in (tuple(member_loads[:size]), (member_loads[0],) * size):
        heaviest_first = sorted(load, reverse=True)

        def busiest(block, heaviest_first=heaviest_first, load=load):
            if min(load) == max(load):
                return max(rank_loads[rank] for rank in block)
            return max(a + b for a, b in zip(sorted(rank_loads[rank] for rank in block), heaviest_first))

        expected = min(blocks, key=lambda block: (busiest(block), block))
        assert least_busy_block(blocks, maxima, minima, rank_loads, load) == expected


def test_ranks_past_the_last_aligned_block_take_single_matrices() -> None:
    # Six ranks hold one aligned block of 4. Largest first: the two 5s on ranks 0 and 1, the
    # team on the block, the 1 on rank 4, which is in no block of 4.
    loads = [(5.0,), (5.0,), (2.0, 2.0, 2.0, 2.0), (1.0,)]
    _, teams = balanced_groups(loads, ["a"] * 4, 6, alpha=1.0, capacity=100.0)
    assert teams == [(0,), (1,), (0, 1, 2, 3), (4,)]


def test_local_members_take_the_ranks_that_hold_their_slices_where_loads_allow() -> None:
    # Rank 1 holds member 2's slice and rank 2 member 1's: they trade. Member 0 and 3 stay.
    held = [[8, 0, 0, 0], [0, 0, 8, 0], [0, 8, 0, 0], [0, 0, 0, 8]]
    assert local_members((4, 5, 6, 7), [1.0] * 4, held) == (4, 6, 5, 7)
    # Member 0 costs more (it decomposes): it keeps its rank, the others still trade.
    assert local_members((4, 5, 6, 7), [2.0, 1.0, 1.0, 1.0], held) == (4, 6, 5, 7)
    held_by_first = [[0, 8, 0, 0], [8, 0, 0, 0], [0, 0, 8, 0], [0, 0, 0, 8]]
    assert local_members((4, 5, 6, 7), [2.0, 1.0, 1.0, 1.0], held_by_first) == (4, 5, 6, 7)
    # Nothing held, or held alike everywhere: the plan's order.
    assert local_members((3, 1), [1.0, 1.0], [[0, 0], [0, 0]]) == (3, 1)
    assert local_members((3, 1), [1.0, 1.0], [[5, 5], [5, 5]]) == (3, 1)


def _specs(*named):
    return describe(list(named), MuonRule(PRESETS["quintic"]))


def test_planner_splits_the_matrix_that_bounds_the_step_and_nothing_else() -> None:
    matrices = _specs(
        ("layers.0.big.weight", (512, 4096)), *((f"layers.{i}.small.weight", (64, 64)) for i in range(6))
    )
    # Collectives cheap next to the big matrix's FLOPs, dear next to a small one's.
    cheap = PlanSettings(flops_per_element=10.0, flops_per_message=1e6)
    sizes = team_sizes(matrices, 4, cheap)
    assert sizes == [4, 1, 1, 1, 1, 1, 1]
    plan = build_plan(matrices, 4, 1, cheap)
    assert plan.teams[0] == (0, 1, 2, 3) and plan.split_matrices() == {4: 1}
    whole = report(build_plan(matrices, 4, 1, PlanSettings(max_team=1)))
    teamed = report(plan)
    assert teamed.makespan < 0.3 * whole.makespan
    assert "computed by teams: 1 by 4 ranks" in teamed.table()
    # Each member multiplies a quarter of the big matrix and forms the 512² polynomial whole.
    a, b = 512, 4096
    assert plan.matrices[0].member_cost(4).flops == 5 * (4 * a * a * b / 4 + 2 * a**3)
    assert max(plan.loads[0]) < matrices[0].cost.flops / 3


def test_planner_keeps_matrices_whole_when_the_team_collectives_cost_more() -> None:
    matrices = _specs(("layers.0.big.weight", (512, 4096)), ("layers.1.small.weight", (64, 64)))
    dear = PlanSettings(flops_per_element=1e9)
    assert team_sizes(matrices, 4, dear) == [1, 1]
    assert build_plan(matrices, 4, 1, dear).split_matrices() == {}
    assert team_sizes(matrices, 4, PlanSettings(max_team=1, **FREE_TEAMS)) == [1, 1]


def test_planner_splits_what_packs_badly_beside_matrices_it_cannot_split() -> None:
    # Two matrices that cannot be split (Shampoo's, factors on both sides) and three that can, on
    # 4 ranks: whole, two of the three share a rank (6, though every bound of one class is ≤ 4.25);
    # in teams of 2 the three fill the two other ranks.
    matrices = [_synthetic("a", 4.0, False), _synthetic("b", 4.0, False)]
    matrices += [_synthetic(c, 3.0, True) for c in "cde"]
    prices = PlanSettings(flops_per_element=0.0, flops_per_message=0.01)
    assert team_sizes(matrices, 4, prices) == [1, 1, 2, 2, 2]
    whole = build_plan(matrices, 4, 1, dataclasses.replace(prices, max_team=1))
    assert max(whole.rank_loads()) == 6.0
    # Split alike, the three pack into 4.53; the overflow's one team of 2 beside them, 3 + 1.51;
    # one team of 4 beside a whole one, 4 + 0.76, has the shortest estimated step, but the team of
    # 2's is within STEP_TOLERANCE of it and packs shorter: that one is kept.
    candidates = [*overflow_sizes(matrices, 4, prices), *searched_sizes(matrices, 4, prices)]
    others = [team_plan(prices, matrices, 4, 1, sizes) for sizes in candidates]
    shortest = min(others, key=estimated_step)
    assert max(shortest.rank_loads()) == pytest.approx(4.76) and shortest.split_matrices() == {4: 1}
    plan = build_plan(matrices, 4, 1, prices)
    assert max(plan.rank_loads()) == pytest.approx(4.51) and plan.split_matrices() == {2: 1}
    assert estimated_step(shortest) < estimated_step(plan) <= (1 + STEP_TOLERANCE) * estimated_step(shortest)


def test_planner_keeps_teams_only_where_the_step_with_its_gathers_and_scatters_is_shorter() -> None:
    # Qwen3 4B, Muon, 256 ranks: teams of 4 for every MLP matrix cut the busiest rank's compute,
    # but the exchange of their slices costs more than that at an H100's InfiniBand prices; with
    # the exchange free, they pay. Teams of 2 for most (searched_sizes) shorten the step at those
    # prices too, and the simulator agrees; so, found by the descent over class-wide sizes, do
    # the MLP matrices in teams of 2 and the query and output projections in teams of 4.
    matrices, _ = preset_matrices("4B", make_rule("muon"), 32, 8)
    plans = {
        policy: build_plan(matrices, 32, 8, PlanSettings(policy=policy))
        for policy in ("canzona", "round_robin")
    }
    plans["whole"] = build_plan(matrices, 32, 8, PlanSettings(max_team=1))
    assert plans["canzona"].split_matrices() == {2: 108, 4: 72}
    steps = {policy: project_step(plan, H100, 2, "bfloat16").pipelined for policy, plan in plans.items()}
    assert steps["canzona"] < 0.93 * min(steps["round_robin"], steps["whole"])
    mlp_in_fours = [4 if max(m.shape) == 9728 else 1 for m in matrices]
    assert estimated_step(team_plan(PlanSettings(), matrices, 32, 8, mlp_in_fours)) > estimated_step(
        plans["whole"]
    )
    free_exchange = PlanSettings(exchange_flops_per_element=0.0, exchange_flops_per_message=0.0)
    teamed = build_plan(matrices, 32, 8, free_exchange)
    assert teamed.split_matrices() == {4: 108}
    assert estimated_step(teamed) < estimated_step(
        build_plan(matrices, 32, 8, dataclasses.replace(free_exchange, max_team=1))
    )


def _synthetic(name: str, flops: float, splits: bool) -> MatrixSpec:
    """A matrix of ``flops`` whose team of ``k`` costs each member ``flops / k`` and one message."""
    teams = tuple(UpdateCost(flops / k, 100, 0, 0, team_messages=1) if splits else None for k in TEAM_SIZES)
    return MatrixSpec(name, (10, 10), name, UpdateCost(flops, 100, 0, 0), (), teams)


def test_team_bound_is_what_the_teams_collectives_cost_at_the_least() -> None:
    # One matrix of 8 on 4 ranks, a message costing 1: whole 8, teams of 2 cost 4 + 1 per member,
    # of 4 cost 2 + 1. The ideal is 2; no plan does better than 3, which a team of 4 reaches.
    prices = PlanSettings(flops_per_element=0.0, flops_per_message=1.0)
    matrices = [_synthetic("a", 8.0, True)]
    assert team_bound(matrices, 4, prices) == 3.0
    teamed = report(build_plan(matrices, 4, 1, prices))
    assert (teamed.ideal, teamed.team_bound, teamed.makespan) == (2.0, 3.0, 3.0)
    # Teams of 2 at most: 5 per member (total 10 over 4 ranks: 2.5).
    assert team_bound(matrices, 4, dataclasses.replace(prices, max_team=2)) == 5.0
    # Two matrices that cannot be split bound it from below, beside three that can.
    mixed = [_synthetic(c, 4.0, False) for c in "bc"] + [_synthetic(c, 3.0, True) for c in "def"]
    assert team_bound(mixed, 4, prices) == pytest.approx(17 / 4)


def test_planner_splits_only_the_matrices_that_do_not_fit_one_to_a_rank() -> None:
    # Five matrices of 3 on 4 ranks, a team's message costing 0.2: whole, two share a rank (6);
    # split alike, teams of 4 cost each rank 5 × (0.75 + 0.2) = 4.75. One matrix in a team of 4
    # beside four whole ones: 3 + 0.95.
    matrices = [_synthetic(c, 3.0, True) for c in "abcde"]
    prices = PlanSettings(
        flops_per_message=0.2, **{k: v for k, v in FREE_TEAMS.items() if k != "flops_per_message"}
    )
    assert team_sizes(matrices, 4, prices) == [4] * 5
    assert max(build_plan(matrices, 4, 1, dataclasses.replace(prices, max_team=1)).rank_loads()) == 6.0
    assert overflow_sizes(matrices, 4, prices) == [[2, 1, 1, 1, 1], [4, 1, 1, 1, 1]]
    plan = build_plan(matrices, 4, 1, prices)
    assert plan.split_matrices() == {4: 1} and max(plan.rank_loads()) == pytest.approx(3.95)
    assert report(plan).team_bound == 3.75  # the mean: the bound does not see that two would share


def test_planner_keeps_the_shortest_estimated_step_not_the_shortest_makespan() -> None:
    # Qwen3 14B, Muon, 256 ranks, H100 prices in bf16: the searched sizes (120 matrices in teams
    # of 2, 49 of 4) pack at 1.30 × the ideal, but the busiest rank receives more: teams of 2 for
    # 200 pack at 1.42 and step faster, estimated and simulated (20.2 ms against 26.2).
    rule = make_rule("muon")
    matrices, _ = preset_matrices("14B", rule, 32, 8)
    prices = H100.repriced(PlanSettings(), rule.matmul_dtype())
    plan = build_plan(matrices, 32, 8, prices)
    packed = team_plan(prices, matrices, 32, 8, searched_sizes(matrices, 256, prices)[-1])
    assert (plan.split_matrices(), packed.split_matrices()) == ({2: 200}, {2: 120, 4: 49})
    assert max(packed.rank_loads()) < 0.92 * max(plan.rank_loads())
    assert estimated_step(plan) < 0.8 * estimated_step(packed)
    steps = [project_step(p, H100, 2, "bfloat16").pipelined for p in (plan, packed)]
    assert steps[0] < 0.8 * steps[1]


def test_of_plans_alike_in_speed_the_planner_keeps_one_that_balances_the_state(monkeypatch) -> None:
    # Qwen3 14B, Shampoo, 256 ranks, H100 prices: 88 matrices in teams of 2 and 32 in teams of 8
    # are the shortest on average (1.213 × the ideal) with a rank holding 1.165 × the mean state;
    # 200 in teams of 2 step within STEP_TOLERANCE (1.232 × the ideal) at 1.089.
    rule = make_rule("shampoo")
    matrices, _ = preset_matrices("14B", rule, 32, 8)
    prices = H100.repriced(PlanSettings(), rule.matmul_dtype())
    plan = build_plan(matrices, 32, 8, prices)
    monkeypatch.setattr(policies, "STATE_BALANCE", 0.0)  # no plan counts as balanced
    shortest = build_plan(matrices, 32, 8, prices)
    assert (plan.split_matrices(), shortest.split_matrices()) == ({2: 200}, {2: 88, 8: 32})
    assert plan.state_max_over_mean() <= STATE_BALANCE < shortest.state_max_over_mean()
    assert shortest.average_makespan() < plan.average_makespan()
    assert estimated_step(plan) <= (1 + STEP_TOLERANCE) * estimated_step(shortest)
    assert report(plan).state_max_over_mean == plan.state_max_over_mean()


def test_the_descent_over_class_sizes_finds_a_shorter_step_than_the_packed_candidates(monkeypatch) -> None:
    # Qwen3 8B, Muon, 256 ranks, H100 prices in bf16: the candidates, chosen by the compute they
    # pack, put the MLP matrices in teams of 4 and leave the narrow key and value projections
    # whole; in teams of 8 these send their owners an eighth each, and the gathers are most of
    # this step. The simulator agrees (11.60 → 10.60 ms).
    rule = make_rule("muon")
    matrices, _ = preset_matrices("8B", rule, 32, 8)
    prices = H100.repriced(PlanSettings(), rule.matmul_dtype())
    descended = build_plan(matrices, 32, 8, prices)
    monkeypatch.setattr(policies, "DESCENT_ROUNDS", 0)
    packed = build_plan(matrices, 32, 8, prices)
    assert (packed.split_matrices(), descended.split_matrices()) == ({4: 108}, {4: 108, 8: 72})
    assert estimated_step(descended) < 0.95 * estimated_step(packed)
    simulated = [project_step(plan, H100, 2, "bfloat16").pipelined for plan in (packed, descended)]
    assert simulated[1] < 0.95 * simulated[0]


def test_planner_splits_the_overflow_of_a_class_that_must_split_further() -> None:
    # Qwen3 14B, SOAP, 256 ranks: each MLP matrix costs 1.43 × the ideal, so it needs a team
    # (halves: 0.77); 240 halves and 80 attention projections (0.91) are 320 items over half the
    # ideal for 256 ranks. Split alike in quarters, three share a rank (1.315); 32 of the 120 in
    # smaller teams leave one such item per rank.
    matrices, _ = preset_matrices("14B", make_rule("soap"), 32, 8)
    settings_ = PlanSettings()
    plans = [
        team_plan(settings_, matrices, 32, 8, sizes) for sizes in overflow_sizes(matrices, 256, settings_)
    ]
    best = min(plans, key=lambda plan: max(plan.rank_loads()))
    assert max(best.rank_loads()) < 1.21 * best.ideal
    mlp = [len(team) for spec, team in zip(best.matrices, best.teams) if max(spec.shape) == 17408]
    assert mlp.count(2) == 88 and len(mlp) == 120


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 400)), min_size=1, max_size=12),
    ranks=st.sampled_from([1, 2, 4, 8, 16]),
    prices=st.sampled_from([FREE_TEAMS, {}, {"flops_per_element": 1e5, "flops_per_message": 1e7}]),
    max_team=st.sampled_from([1, 2, 8]),
)
def test_no_plan_beats_the_team_bound_and_it_is_at_least_the_ideal(shapes, ranks, prices, max_team) -> None:
    matrices = _specs(*((f"layers.{i}.w.weight", shape) for i, shape in enumerate(shapes)))
    for policy in ("canzona", "lpt", "round_robin"):
        plan_settings = PlanSettings(policy=policy, max_team=max_team, **prices)
        measured = report(build_plan(matrices, ranks, 1, plan_settings))
        assert measured.ideal * (1 - 1e-12) <= measured.team_bound <= measured.makespan * (1 + 1e-12)


@pytest.mark.parametrize(("preset", "dp"), [("0.6B", 128), ("32B", 32)])
def test_canzona_reaches_the_team_bound_on_qwen3_with_muon(preset, dp) -> None:
    # Where teams of 8 (0.6B on 1,024 ranks) or of 2 (32B on 256) are the least the collectives
    # allow, the packer loses nothing to the bound (`canzona plan --sweep` prints both).
    matrices, _ = preset_matrices(preset, make_rule("muon"), dp, 8)
    measured = report(build_plan(matrices, dp, 8, PlanSettings()))
    assert measured.team_bound > 1.05 * measured.ideal
    assert measured.makespan <= measured.team_bound * (1 + 1e-9)


def test_h100_prices_are_in_the_flops_of_the_rules_matrix_products() -> None:
    # The defaults are an H100's in bf16 FLOPs of 2-byte elements; Shampoo's and SOAP's float32
    # products run at 67 TFLOP/s, not 989: the same collective costs them 14.8× fewer FLOPs, and
    # their float32 elements twice the bytes.
    bf16 = priced(PlanSettings(), "h100", None, "cuda", torch.bfloat16)
    assert bf16 == PlanSettings()
    for name, value in H100.plan_prices("bfloat16", 2).items():
        assert getattr(PlanSettings(), name) == pytest.approx(value, rel=1e-12)
    float32 = priced(PlanSettings(), "h100", None, "cuda", torch.float32)
    ratio = 67 / 989.4
    assert float32.flops_per_message == pytest.approx(ratio * bf16.flops_per_message)
    assert float32.exchange_flops_per_message == pytest.approx(ratio * bf16.exchange_flops_per_message)
    assert float32.flops_per_element == pytest.approx(2 * ratio * bf16.flops_per_element)
    assert float32.exchange_flops_per_element == pytest.approx(2 * ratio * bf16.exchange_flops_per_element)
    assert float32.max_team == bf16.max_team and float32.policy == bf16.policy
    free = dataclasses.replace(PlanSettings(), **FREE_TEAMS)  # a planner told collectives are free
    assert priced(free, "h100", None, "cuda", torch.float32) == free


def _measured_prices(rank: int, world_size: int) -> None:
    prices = measure_team_costs()
    assert set(prices) == {
        "flops_per_element",
        "flops_per_message",
        "exchange_flops_per_element",
        "exchange_flops_per_message",
    }
    assert all(price > 0 for price in prices.values())
    # The gathers cross the job's links, as the teams do; the latency is per peer of an exchange.
    assert prices["exchange_flops_per_element"] == prices["flops_per_element"]
    assert prices["exchange_flops_per_message"] == pytest.approx(
        prices["flops_per_message"] / (world_size - 1)
    )
    everyone = [None] * world_size
    dist.all_gather_object(everyone, prices)
    assert all(theirs == prices for theirs in everyone)  # every rank plans alike


def test_measured_prices_cover_teams_and_exchanges_and_agree_on_every_rank() -> None:
    run_on_ranks(3, _measured_prices)


def test_prices_are_measured_in_the_dtype_of_the_rules_matrix_products() -> None:
    # FLOPs of Muon's bf16 Newton–Schulz and of Shampoo's and SOAP's float32 products differ
    # about 4× in time on one device: `team_prices="measure"` times the rule's own.
    quintic = PRESETS["quintic"]
    assert MuonRule(quintic).matmul_dtype() == torch.bfloat16
    assert MuonRule(quintic, compute_dtype=torch.float32).matmul_dtype() == torch.float32
    assert ShampooRule().matmul_dtype() == SOAPRule().matmul_dtype() == torch.float32
    assert RowBlockRule(MuonRule(quintic), 2).matmul_dtype() == torch.bfloat16


def _mixed_compute_dtypes(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    shapes = [(8, 16), (12, 10), (8, 16)]
    weights = [
        nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [Shard(0)], src_data_rank=None))
        for shape in shapes
    ]

    def muon(team_prices):
        groups = [
            {"params": weights[:1]},
            {"params": weights[1:2], "compute_dtype": "float32"},
            {"params": weights[2:], "compute_dtype": "float64"},
        ]
        return lc.Muon(groups, lr=0.02, plan=lc.PlanConfig(team_prices=team_prices))

    for weight in weights:
        weight.grad = distribute_tensor(torch.randn(weight.shape), mesh, [Shard(0)], src_data_rank=None)
    # At H100 rates each matrix's FLOPs are weighed by the time of its dtype's: float32 and
    # float64 products are 14.8× slower than bf16's there. No warning.
    optimizer = muon("h100")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    (engine,) = optimizer.engines.values()
    ratio = H100.matmul_flops("bfloat16") / H100.matmul_flops("float32")
    rules = [MuonRule(PRESETS["quintic"], compute_dtype=dtype) for dtype in DTYPES.values()]
    for spec, rule, weight in zip(engine.plan.matrices, rules, (1.0, ratio, ratio)):
        assert spec.cost.flops == pytest.approx(rule.cost(spec.shape).flops * weight)
    # Measured rates weigh them too (the ranks agree on one figure per dtype).
    measured = muon("measure")
    measured.step()
    (engine,) = measured.engines.values()
    assert set(engine.flops_weights) == set(DTYPES.values()) and engine.flops_weights[torch.bfloat16] == 1.0
    assert all(weight > 0 for weight in engine.flops_weights.values())
    # Prices given as figures say nothing of the dtypes' rates: named (by rank 0 only: every
    # rank would say the same), and weighed alike.
    figures = muon((100.0, 1e6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        figures.step()
    said = [str(w.message) for w in caught if "team_prices are given" in str(w.message)]
    assert len(said) == (rank == 0)
    assert all("multiply in bfloat16, float32, float64, and team_prices are given" in m for m in said)


def test_param_groups_that_multiply_in_different_dtypes_are_weighed_by_time() -> None:
    run_on_ranks(2, _mixed_compute_dtypes)


def _float64_muon(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    initial, grads = torch.randn(12, 20), [torch.randn(12, 20) for _ in range(3)]
    sharded = nn.Parameter(distribute_tensor(initial, mesh, [Shard(0)], src_data_rank=None))
    whole = nn.Parameter(initial.clone())
    optimizers = [lc.Muon([param], lr=0.02, compute_dtype="float64") for param in (sharded, whole)]
    for grad in grads:
        sharded.grad = distribute_tensor(grad, mesh, [Shard(0)], src_data_rank=None)
        whole.grad = grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    torch.testing.assert_close(sharded.full_tensor(), whole.detach(), rtol=1e-12, atol=1e-12)


def test_float64_muon_on_a_mesh_equals_one_device() -> None:
    # The default team prices are an H100's in FLOPs of the rule's dtype: float64 has its rate.
    run_on_ranks(2, _float64_muon)


def _with_free_teams(optimizer_class):
    """``optimizer_class`` whose plan uses teams wherever they lower the bound (collectives
    priced at zero); each instance is kept in `CREATED`."""

    class WithFreeTeams(optimizer_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            CREATED.append(self)

        def plan_settings(self) -> PlanSettings:
            return dataclasses.replace(super().plan_settings(), **FREE_TEAMS)

    WithFreeTeams.__name__ = f"Team{optimizer_class.__name__}"
    return WithFreeTeams


TeamMuon = _with_free_teams(lc.Muon)
CREATED: list[lc.MatrixOptimizer] = []


#: ``(Newton–Schulz form, overlap)`` per mesh: the standard form everywhere, the Gram form on
#: the 4-rank meshes, the micro-groups one after another (no overlap) on dp2×tp2.
RUNS_ON_MESH = {
    "dp2": (("standard", True),),
    "tp2": (("standard", True),),
    "dp4": (("standard", True), ("gram", True), ("gram-symmetric", True)),
    "dp2xtp2": (("standard", True), ("standard", False), ("gram", False), ("standard-symmetric", True)),
}


def _teams_on_mesh(rank: int, world_size: int, mesh_name: str) -> None:
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for form, overlap in RUNS_ON_MESH[mesh_name]:
        OPTIMIZERS["team_muon"] = (TeamMuon, {**OPTIMIZERS["muon"][1], "ns_form": form})
        _run_combination(rank, mesh, "team_muon", {"policy": "canzona"}, overlap)
        (engine,) = CREATED[-1].engines.values()
        assert engine.plan.split_matrices(), f"no team on {mesh_name} ({form})"
        stats = torch.tensor([engine.stats.team_matrices, engine.stats.team_collectives])
        dist.all_reduce(stats)
        assert stats.min() > 0


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_team_updates_equal_single_process(mesh_name: str) -> None:
    assert set(RUNS_ON_MESH) == set(MESHES)
    run_on_ranks(math.prod(MESHES[mesh_name][0]), _teams_on_mesh, mesh_name)


#: Matrices that teams split along their long side: ``tall`` preconditioned on its columns,
#: ``wide`` on its rows (its columns turned into rows), ``bare`` on neither (both sides longer
#: than ``max_precond_dim``), ``both``, ``both_wide`` and ``small`` on both sides. Sharded across
#: and along the long side.
KRONECKER_SHAPES = {
    "tall": (130, 40),
    "wide": (40, 130),
    "bare": (100, 70),
    "small": (9, 7),
    "both": (62, 44),
    "both_wide": (44, 62),
}
KRONECKER_PLACEMENTS = {
    1: {
        "tall": [Shard(0)],
        "wide": [Shard(0)],
        "bare": [Shard(1)],
        "small": [Shard(0)],
        "both": [Shard(0)],
        "both_wide": [Shard(0)],
    },
    2: {
        "tall": [Shard(0), Shard(1)],
        "wide": [Shard(0), Shard(0)],
        "bare": [Shard(1), Shard(0)],
        "small": [Shard(0), Shard(1)],
        "both": [Shard(1), Shard(0)],
        "both_wide": [Shard(0), Shard(1)],
    },
}
KRONECKER_OPTIMIZERS = {
    "shampoo": (lc.Shampoo, {"precondition_frequency": 2, "start_preconditioning_step": 2}),
    "soap": (lc.SOAP, {"precondition_frequency": 2}),
}


def _reference_and_sharded(full: dict, mesh, placements: dict) -> tuple[dict, dict]:
    """Parameters of the ``full`` values: for the one-process reference, and sharded on ``mesh``."""
    reference = {name: nn.Parameter(value.clone()) for name, value in full.items()}
    sharded = {
        name: nn.Parameter(distribute_tensor(value, mesh, placements[name], src_data_rank=None))
        for name, value in full.items()
    }
    return reference, sharded


def _members_in_reverse(plan):
    """``plan`` with every team's ranks listed in reverse: its first member on its last rank."""
    teams = tuple(team[::-1] for team in plan.teams)
    return dataclasses.replace(plan, teams=teams, owners=tuple(team[0] for team in teams))


def _kronecker_teams(rank: int, world_size: int, mesh_name: str, reverse: bool = False) -> None:
    if reverse:  # members out of rank order, as the packer and locality may list them: gathers reordered
        engine_module.MeshEngine._local_team_members = lambda self, plan: _members_in_reverse(plan)
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    placements = KRONECKER_PLACEMENTS[mesh.ndim]
    for name, (optimizer_class, kwargs) in KRONECKER_OPTIMIZERS.items():
        torch.manual_seed(0)
        full = {key: torch.randn(size) for key, size in KRONECKER_SHAPES.items()}
        reference_params, params = _reference_and_sharded(full, mesh, placements)
        settings = {"lr": 0.01, "max_precond_dim": 64, **kwargs}
        reference = optimizer_class(list(reference_params.items()), **settings)
        # One optimizer per matrix (``small`` beside ``bare``): alone, each is split over every
        # rank, except where the rule cannot split it.
        alone = [["tall"], ["wide"], ["bare", "small"], ["both"], ["both_wide"]]
        teamed = _with_free_teams(optimizer_class)
        optimizers = [teamed([(key, params[key]) for key in keys], **settings) for keys in alone]
        for step in range(5):
            generator = torch.Generator().manual_seed(step)
            for key, size in KRONECKER_SHAPES.items():
                # Small integers: the factor's sum over slices is exact in any order. SOAP's
                # eigenbasis would turn the ulps of another order into up to 6e-4 of an update
                # (measured on one process, the factor summed over slices instead of whole: the
                # team's result equals that bit for bit).
                grad = torch.randint(-3, 4, size, generator=generator).float()
                grad = None if (step, key) in ((1, "wide"), (2, "both")) else grad
                sharded = None
                if grad is not None:
                    sharded = distribute_tensor(grad, mesh, placements[key], src_data_rank=None)
                if (step, key) == (3, "tall"):
                    # Rank 0 lost its block of the gradient: its team sees zeros there.
                    mask = torch.full_like(sharded.to_local(), float(rank != 0))
                    mask = DTensor.from_local(mask, mesh, placements[key], shape=size, stride=grad.stride())
                    grad = grad * mask.full_tensor()
                    sharded = None if rank == 0 else sharded
                reference_params[key].grad, params[key].grad = grad, sharded
            for optimizer in optimizers:
                optimizer.step()
            reference.step()
        for optimizer, keys in zip(optimizers, alone):
            (engine,) = optimizer.engines.values()
            split = keys  # ``small`` too: both its sides have a factor
            expected = {world_size: len(split)}
            assert engine.plan.split_matrices() == expected, (name, mesh_name, engine.plan.teams)
            assert all(sorted(team) == list(range(world_size)) for team in engine.plan.teams)
            assert not reverse or all(list(team) == sorted(team, reverse=True) for team in engine.plan.teams)
            assert engine.stats.team_matrices == len(split)
        for key, value in reference_params.items():
            label = f"{name} {key} on {mesh_name}"
            torch.testing.assert_close(
                params[key].full_tensor(),
                value.detach(),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, label=label: f"{label}: {m}",
            )


@pytest.mark.parametrize("mesh_name", ["dp4", "tp2", "dp2xtp2"])  # dp4 covers dp2's case
def test_shampoo_and_soap_team_updates_equal_single_process(mesh_name: str) -> None:
    run_on_ranks(math.prod(MESHES[mesh_name][0]), _kronecker_teams, mesh_name)


def test_teams_whose_members_are_out_of_rank_order_equal_single_process() -> None:
    # The packer puts a team's busier members (a decomposition each) on its less loaded ranks.
    run_on_ranks(4, _kronecker_teams, "dp2xtp2", True)


def _wide_matrices(rank: int, world_size: int) -> None:
    """Wide and tall matrices whose teams form the polynomial whole (`splits_polynomial` false),
    sharded across their long side and across their short side, with a missing gradient."""
    mesh = init_device_mesh("cpu", (world_size,))
    shapes = {"wide": (12, 200), "tall": (200, 12), "cut_short": (12, 200)}
    placements = {"wide": [Shard(1)], "tall": [Shard(0)], "cut_short": [Shard(0)]}
    torch.manual_seed(0)
    full = {name: torch.randn(shape) for name, shape in shapes.items()}
    reference_params, params = _reference_and_sharded(full, mesh, placements)
    kwargs = {"lr": 0.02, "compute_dtype": "float32"}
    reference = lc.Muon(list(reference_params.items()), **kwargs)
    optimizer = TeamMuon(list(params.items()), **kwargs)
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        for name, shape in shapes.items():
            grad = None if (step, name) == (1, "tall") else torch.randn(shape, generator=generator)
            reference_params[name].grad = grad
            params[name].grad = (
                None if grad is None else distribute_tensor(grad, mesh, placements[name], src_data_rank=None)
            )
        optimizer.step()
        reference.step()
    (engine,) = optimizer.engines.values()
    assert sum(engine.plan.split_matrices().values()) == 3
    for name, value in reference_params.items():
        torch.testing.assert_close(params[name].full_tensor(), value.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_teams_that_form_the_polynomial_whole_equal_single_process() -> None:
    assert not any(splits_polynomial(*shape, 4) for shape in ((12, 200), (200, 12)))
    run_on_ranks(4, _wide_matrices)


def _one_sum_per_round(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    weight = nn.Parameter(distribute_tensor(torch.randn(12, 200), mesh, [Shard(1)], src_data_rank=None))
    optimizer = TeamMuon([("weight", weight)], lr=0.02, ns_steps=5)  # bf16 Gram matrices
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    (engine,) = optimizer.engines.values()
    assert engine.plan.teams == ((0, 1, 2, 3),)
    assert engine.stats.team_collectives == 5


def test_a_team_round_is_one_collective_on_gloo() -> None:
    # A round's float32 norm and bf16 Gram matrix are both added in float32 on gloo: one sum per
    # Newton–Schulz iteration, not two in the first.
    run_on_ranks(4, _one_sum_per_round)


def _slices_where_they_lie(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    reference = nn.Linear(8, 64, bias=False)  # a tall weight: teams slice its rows
    model = nn.Linear(8, 64, bias=False)
    model.weight.data.copy_(reference.weight.data)
    parallelize_module(model, mesh["tp"], ColwiseParallel())
    fully_shard(model, mesh=mesh["dp"])  # rank (d, t) holds rows 32t + 16d to 32t + 16d + 16
    kwargs = {"lr": 0.02, "compute_dtype": "float32"}
    optimizer = TeamMuon([("weight", model.weight)], **kwargs)
    reference_optimizer = lc.Muon([("weight", reference.weight)], **kwargs)
    for step in range(3):
        grad = torch.randn(64, 8, generator=torch.Generator().manual_seed(step))
        reference.weight.grad = grad
        model.weight.grad = distribute_tensor(grad, mesh, model.weight.placements, src_data_rank=None)
        optimizer.step()
        reference_optimizer.step()
    (engine,) = optimizer.engines.values()
    assert engine.plan.teams == ((0, 2, 1, 3),)  # member m on the rank that holds rows 16m to 16m + 16
    assert engine.stats.bytes_sent == 0  # the last step's: every slice was where it is computed
    # ...and what a rank gives itself skips the all-to-all buffers: both are empty.
    (exchange,) = engine.exchanges
    assert exchange.gather_self and exchange.scatter_self
    sizes = (exchange.gather_send_sizes, exchange.gather_recv_sizes, exchange.scatter_send_sizes)
    assert all(sum(each) == 0 for each in (*sizes, exchange.scatter_recv_sizes))
    torch.testing.assert_close(model.weight.full_tensor(), reference.weight.detach(), rtol=1e-5, atol=1e-6)


def test_team_members_compute_the_slices_they_hold() -> None:
    run_on_ranks(4, _slices_where_they_lie)


#: A team's rule and its optimizer: SOAP's rounds depend on its step count (a basis refresh every
#: second step), which the failing member had counted before it failed; Shampoo's too (factors on
#: both sides of the ``12 × 200`` weight: its gathers, and a decomposition in the failed step).
FAILING_TEAMS = {
    "muon": (MuonRule, lambda params: TeamMuon(params, lr=0.02, compute_dtype="float32")),
    "soap": (
        SOAPRule,
        lambda params: _with_free_teams(lc.SOAP)(
            params, lr=0.01, precondition_frequency=2, max_precond_dim=64
        ),
    ),
    "shampoo": (
        ShampooRule,
        lambda params: _with_free_teams(lc.Shampoo)(
            params, lr=0.01, precondition_frequency=2, start_preconditioning_step=2
        ),
    ),
}


def _a_member_fails(rank: int, world_size: int, optimizer_name: str) -> None:
    rule_class, build = FAILING_TEAMS[optimizer_name]
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    weight = nn.Parameter(distribute_tensor(torch.randn(12, 200), mesh, [Shard(1)], src_data_rank=None))
    optimizer = build([("weight", weight)])
    weight.grad = distribute_tensor(torch.randn(12, 200), mesh, [Shard(1)], src_data_rank=None)
    optimizer.step()
    (engine,) = optimizer.engines.values()
    assert engine.plan.teams == ((0, 1, 2, 3),)
    original = rule_class.team_direction
    failures = []

    def fails_in_the_second_round(self, matrix, shape, member, size, state):
        steps = original(self, matrix, shape, member, size, state)
        reply = yield next(steps)
        if not failures:  # once: the rank then rejoins its team's rounds on zeros
            failures.append(member)
            raise torch.OutOfMemoryError("injected in a team")
        return (yield from _forward(steps, reply))

    rule_class.team_direction = fails_in_the_second_round if rank == world_size - 1 else original
    try:
        with pytest.raises(RuntimeError, match=r"failed on rank 3: OutOfMemoryError\('injected in a team'\)"):
            optimizer.step()
    finally:
        rule_class.team_direction = original
    dist.barrier()  # every rank got here: nobody is left in a team's collective
    assert failures == ([3] if rank == 3 else [])
    optimizer.step()  # the next step runs normally
    assert engine.stats.team_collectives > 0


def _forward(steps, reply):
    """Hand ``reply`` on to ``steps`` and relay the rest of its rounds; its result."""
    try:
        while True:
            reply = yield steps.send(reply)
    except StopIteration as done:
        return done.value


def _members_fail(rank: int, world_size: int) -> None:
    for optimizer_name in FAILING_TEAMS:
        _a_member_fails(rank, world_size, optimizer_name)


def test_a_failure_in_a_team_is_the_same_error_on_every_rank_in_seconds() -> None:
    run_on_ranks(4, _members_fail, timeout=30.0)


def test_greedy_packing_and_even_spreading_of_searched_sizes() -> None:
    # Two items of 3 on two ranks, then a team of 2 at 2 per member: 5; three of 1: 2.
    assert greedy_makespan([(1, 2, (2.0, 2.0)), (2, 1, (3.0,))], 2) == 5.0
    assert greedy_makespan([(3, 1, (1.0,))], 2) == 2.0
    # Members that cost differently: the busier member on the less loaded rank (3 + 1, 2 + 2).
    assert greedy_makespan([(1, 1, (3.0,)), (1, 1, (2.0,)), (1, 2, (1.0, 2.0))], 2) == 4.0
    # Two of a class of eight in teams of 4, spread over it in model order.
    assert sizes_of([list(range(8))], [{2: 6, 4: 2}], 8) == [2, 2, 4, 2, 2, 2, 4, 2]


def test_searched_sizes_pack_what_the_packing_bound_misjudges() -> None:
    # Qwen3 14B, Muon, 512 ranks: by the packing bound, MLP matrices in teams of 4 beside
    # attention projections in teams of 2 (1.92 × the ideal); packed, some move to teams of 8.
    rule = make_rule("muon")
    matrices, _ = preset_matrices("14B", rule, 64, 8)
    prices = H100.repriced(PlanSettings(), rule.matmul_dtype())
    greedy = team_plan(prices, matrices, 64, 8, team_sizes(matrices, 512, prices))
    searched = [team_plan(prices, matrices, 64, 8, s) for s in searched_sizes(matrices, 512, prices)]
    assert max(greedy.rank_loads()) > 1.9 * greedy.ideal
    assert min(max(plan.rank_loads()) for plan in searched) < 1.57 * greedy.ideal
    assert max(build_plan(matrices, 64, 8, prices).rank_loads()) < 1.57 * greedy.ideal
