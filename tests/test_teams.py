"""Teams: several ranks compute one matrix's update together, exactly.

The algebra is checked in one process (each member's computation run in lockstep, their
requests combined by hand); the engine on gloo ranks, against the single-process optimizer on
the full matrices, with the planner made to use teams; the planner in pure logic.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_on_ranks
from test_engine_exactness import MESHES, OPTIMIZERS, _run_combination
from torch.distributed.device_mesh import init_device_mesh

import lightning_canzona as lc
from lightning_canzona.planning import PlanSettings, build_plan, describe, report
from lightning_canzona.planning.plan import team_sizes
from lightning_canzona.planning.teams import candidate_teams, member_blocks, split_sizes
from lightning_canzona.rules.base import TeamSum
from lightning_canzona.rules.muon import MuonRule
from lightning_canzona.rules.newton_schulz import PRESETS, newton_schulz, team_newton_schulz

#: Collectives cost nothing: the planner splits every matrix whose split lowers the bound.
FREE_TEAMS = {"team_flops_per_element": 0.0, "team_flops_per_message": 0.0}


def _in_lockstep(full: torch.Tensor, size: int) -> torch.Tensor:
    """Every member's `team_newton_schulz` on its slice, requests combined here, slices joined."""
    blocks = member_blocks(full.shape, size)
    tall = full.size(-2) > full.size(-1)
    runs = [
        team_newton_schulz(
            full[tuple(slice(o, o + n) for o, n in zip(offset, shape))],
            tall,
            PRESETS["quintic"],
            5,
            1e-7,
            torch.float32,
            member,
            size,
        )
        for member, (offset, shape) in enumerate(blocks)
    ]
    requests = [next(run) for run in runs]
    results: list[torch.Tensor] = []
    while not results:
        if isinstance(requests[0], TeamSum):
            reply = sum(request.tensor for request in requests)
        else:
            reply = torch.cat([request.tensor for request in requests], dim=-2)
        for member, run in enumerate(runs):
            try:
                requests[member] = run.send(reply)
            except StopIteration as done:
                results.append(done.value)
    return torch.cat(results, dim=-2 if tall else -1)


@pytest.mark.parametrize("shape", [(6, 50), (50, 6), (33, 33), (3, 7, 20)])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_team_newton_schulz_equals_one_rank(shape, size) -> None:
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(size))
    expected = newton_schulz(matrix, PRESETS["quintic"], 5, 1e-7, torch.float32)
    torch.testing.assert_close(_in_lockstep(matrix, size), expected, rtol=1e-5, atol=1e-5)


def test_split_sizes_member_blocks_and_aligned_teams() -> None:
    assert split_sizes(7, 3) == (3, 2, 2)
    assert member_blocks((130, 70), 4) == [
        ((0, 0), (33, 70)),
        ((33, 0), (33, 70)),
        ((66, 0), (32, 70)),
        ((98, 0), (32, 70)),
    ]
    assert member_blocks((70, 130), 2) == [((0, 0), (70, 65)), ((0, 65), (70, 65))]
    assert candidate_teams(6, 4) == [(0, 1, 2, 3)]


def _specs(*named):
    return describe(list(named), MuonRule(PRESETS["quintic"]))


def test_planner_splits_the_matrix_that_bounds_the_step_and_nothing_else() -> None:
    matrices = _specs(
        ("layers.0.big.weight", (512, 4096)), *((f"layers.{i}.small.weight", (64, 64)) for i in range(6))
    )
    free = PlanSettings(**FREE_TEAMS)
    sizes = team_sizes(matrices, 4, free)
    assert sizes == [4, 1, 1, 1, 1, 1, 1]
    plan = build_plan(matrices, 4, 1, free)
    assert plan.teams[0] == (0, 1, 2, 3) and plan.split_matrices() == {4: 1}
    whole = report(build_plan(matrices, 4, 1, PlanSettings(max_team=1)))
    teamed = report(plan)
    assert teamed.makespan < 0.3 * whole.makespan
    assert "computed by teams: 1 by 4 ranks" in teamed.table()
    # Each member carries a quarter of the big matrix (the Gram rows and the slices are even).
    assert plan.loads[0] == pytest.approx(matrices[0].cost.flops / 4)


def test_planner_keeps_matrices_whole_when_the_team_collectives_cost_more() -> None:
    matrices = _specs(("layers.0.big.weight", (512, 4096)), ("layers.1.small.weight", (64, 64)))
    dear = PlanSettings(team_flops_per_element=1e9)
    assert team_sizes(matrices, 4, dear) == [1, 1]
    assert build_plan(matrices, 4, 1, dear).split_matrices() == {}
    assert team_sizes(matrices, 4, PlanSettings(max_team=1, **FREE_TEAMS)) == [1, 1]


class TeamMuon(lc.Muon):
    """Muon whose plan uses teams wherever they lower the bound (collectives priced at zero)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plan_settings = dataclasses.replace(self.plan_settings, **FREE_TEAMS)
        CREATED.append(self)


CREATED: list[TeamMuon] = []


def _teams_on_mesh(rank: int, world_size: int, mesh_name: str) -> None:
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    OPTIMIZERS["team_muon"] = (TeamMuon, OPTIMIZERS["muon"][1])
    for overlap in (True, False):
        _run_combination(rank, mesh, "team_muon", {"policy": "canzona"}, overlap)
        (engine,) = CREATED[-1].engines.values()
        assert engine.plan.split_matrices(), f"no team on {mesh_name}"
        stats = torch.tensor([engine.stats.team_matrices, engine.stats.team_collectives])
        dist.all_reduce(stats)
        assert stats.min() > 0


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_team_updates_equal_single_process(mesh_name: str) -> None:
    run_on_ranks(math.prod(MESHES[mesh_name][0]), _teams_on_mesh, mesh_name)
