"""Matrices computed by teams on a mesh equal one process: Muon, Shampoo and SOAP, on DP, TP and
DP × TP, members in or out of rank order, one collective per round."""

from __future__ import annotations

import dataclasses
import math

import emulated_nccl
import pytest
import torch
import torch.distributed as dist
from free_teams import CREATED, TeamMuon, with_free_teams
from multiprocess import DEVICE, run_on_ranks
from test_engine_exactness import MESHES, OPTIMIZERS, _run_combination
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import lightning_canzona as lc
from lightning_canzona.distributed import engine as engine_module
from lightning_canzona.distributed import team_collectives
from lightning_canzona.rules.newton_schulz import (
    splits_polynomial,
)

#: ``(Newton–Schulz form, overlap)`` per mesh: the standard form everywhere, the Gram form on
#: the 4-rank meshes, the micro-groups one after another (no overlap) on dp2×tp2.
RUNS_ON_MESH = {
    "dp2": (("standard", True),),
    "tp2": (("standard", True),),
    "dp4": (("standard", True), ("gram", True), ("gram-symmetric", True)),
    "dp2xtp2": (("standard", True), ("standard", False), ("gram", False), ("standard-symmetric", True)),
    # Teams in each replica (the engine's exactness covers the plan spread over the replicas).
    "rep2xdp2": (("standard", True),),
    "rep2xtp2": (("standard", True),),
}


def _teams_on_mesh(rank: int, world_size: int, mesh_name: str) -> None:
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh(DEVICE, shape, mesh_dim_names=names)
    for form, overlap in RUNS_ON_MESH[mesh_name]:
        OPTIMIZERS["team_muon"] = (TeamMuon, {**OPTIMIZERS["muon"][1], "ns_form": form})
        replicated = {"replicas": "replicated"} if "replicate" in names else {}
        _run_combination(rank, mesh, "team_muon", {"policy": "canzona", **replicated}, overlap)
        (engine,) = CREATED[-1].engines.values()
        assert engine.plan.split_matrices(), f"no team on {mesh_name} ({form})"
        stats = torch.tensor([engine.stats.team_matrices, engine.stats.team_collectives], device=DEVICE)
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
        engine_module.MeshEngine._local_team_members = lambda self, plan, items: _members_in_reverse(plan)
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh(DEVICE, shape, mesh_dim_names=names)
    placements = KRONECKER_PLACEMENTS[mesh.ndim]
    for name, (optimizer_class, kwargs) in KRONECKER_OPTIMIZERS.items():
        torch.manual_seed(0)
        full = {key: torch.randn(size).to(DEVICE) for key, size in KRONECKER_SHAPES.items()}
        reference_params, params = _reference_and_sharded(full, mesh, placements)
        settings = {"lr": 0.01, "max_precond_dim": 64, **kwargs}
        reference = optimizer_class(list(reference_params.items()), **settings)
        # One optimizer per matrix (``small`` beside ``bare``): alone, each is split over every
        # rank, except where the rule cannot split it.
        alone = [["tall"], ["wide"], ["bare", "small"], ["both"], ["both_wide"]]
        teamed = with_free_teams(optimizer_class)
        optimizers = [teamed([(key, params[key]) for key in keys], **settings) for keys in alone]
        for step in range(5):
            generator = torch.Generator().manual_seed(step)
            for key, size in KRONECKER_SHAPES.items():
                # Small integers: the factor's sum over slices is exact in any order. SOAP's
                # eigenbasis would turn the ulps of another order into up to 6e-4 of an update
                # (measured on one process, the factor summed over slices instead of whole: the
                # team's result equals that bit for bit).
                grad = torch.randint(-3, 4, size, generator=generator).float().to(DEVICE)
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
    mesh = init_device_mesh(DEVICE, (world_size,))
    shapes = {"wide": (12, 200), "tall": (200, 12), "cut_short": (12, 200)}
    placements = {"wide": [Shard(1)], "tall": [Shard(0)], "cut_short": [Shard(0)]}
    torch.manual_seed(0)
    full = {name: torch.randn(shape).to(DEVICE) for name, shape in shapes.items()}
    reference_params, params = _reference_and_sharded(full, mesh, placements)
    kwargs = {"lr": 0.02, "compute_dtype": "float32"}
    reference = lc.Muon(list(reference_params.items()), **kwargs)
    optimizer = TeamMuon(list(params.items()), **kwargs)
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        for name, shape in shapes.items():
            grad = None if (step, name) == (1, "tall") else torch.randn(shape, generator=generator).to(DEVICE)
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
    mesh = init_device_mesh(DEVICE, (world_size,))
    full = torch.randn(12, 200, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    weight = nn.Parameter(distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None))
    optimizer = TeamMuon([("weight", weight)], lr=0.02, ns_steps=5, compute_dtype="bfloat16")
    weight.grad = torch.ones_like(weight)
    sums = []
    original = team_collectives.Reduction

    class Kept(original):
        """Each team sum's buffer as sent and as summed."""

        def __init__(self, tensor, op, group) -> None:
            self.sent, self.group = tensor.clone(), group
            super().__init__(tensor, op, group)
            sums.append(self)

    team_collectives.Reduction = Kept
    try:
        optimizer.step()
    finally:
        team_collectives.Reduction = original
    (engine,) = optimizer.engines.values()
    assert engine.plan.teams == ((0, 1, 2, 3),)
    assert engine.stats.team_collectives == 5 == len(sums)
    # On the wire: float32 (the norm beside the Gram matrix in the first round), on every backend.
    wire = [call for call in emulated_nccl.CALLS if call.group is sums[0].group]
    assert [call.dtypes for call in wire] == [(torch.float32,)] * 5, wire
    # Each sum is the float32 sum of the members' bf16 partial Gram matrices, rounded once.
    for kept in sums:
        everyone = [torch.empty_like(kept.sent) for _ in range(world_size)]
        dist.all_gather(everyone, kept.sent)
        assert all(part[1:].eq(part[1:].bfloat16().float()).all() for part in everyone)  # bf16 values
        torch.testing.assert_close(kept.tensor, torch.stack(everyone).sum(dim=0), rtol=1e-6, atol=0.0)


def test_a_team_round_is_one_float32_sum_on_every_backend() -> None:
    # A round's float32 norm and bf16 Gram matrix are added in float32 on any backend (NCCL would
    # add bf16 in bf16, rounding at every member): one sum per Newton–Schulz iteration.
    run_on_ranks(4, _one_sum_per_round, nccl_like=True)


def _slices_where_they_lie(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    reference = nn.Linear(8, 64, bias=False, device=DEVICE)  # a tall weight: teams slice its rows
    model = nn.Linear(8, 64, bias=False, device=DEVICE)
    model.weight.data.copy_(reference.weight.data)
    parallelize_module(model, mesh["tp"], ColwiseParallel())
    fully_shard(model, mesh=mesh["dp"])  # rank (d, t) holds rows 32t + 16d to 32t + 16d + 16
    kwargs = {"lr": 0.02, "compute_dtype": "float32"}
    optimizer = TeamMuon([("weight", model.weight)], **kwargs)
    reference_optimizer = lc.Muon([("weight", reference.weight)], **kwargs)
    for step in range(3):
        grad = torch.randn(64, 8, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        reference.weight.grad = grad
        model.weight.grad = distribute_tensor(grad, mesh, model.weight.placements, src_data_rank=None)
        optimizer.step()
        reference_optimizer.step()
    (engine,) = optimizer.engines.values()
    assert engine.plan.teams == ((0, 2, 1, 3),)  # member m on the rank that holds rows 16m to 16m + 16
    assert engine.stats.bytes_sent == 0  # the last step's: every slice was where it is computed
    # ...and what a rank gives itself skips the all-to-all buffers: both are empty.
    (exchange,) = engine.layout.exchanges
    assert exchange.gather_self and exchange.scatter_self
    sizes = (exchange.gather_send_sizes, exchange.gather_recv_sizes, exchange.scatter_send_sizes)
    assert all(sum(each) == 0 for each in (*sizes, exchange.scatter_recv_sizes))
    torch.testing.assert_close(model.weight.full_tensor(), reference.weight.detach(), rtol=1e-5, atol=1e-6)


def test_team_members_compute_the_slices_they_hold() -> None:
    run_on_ranks(4, _slices_where_they_lie)


#: A team's rule and its optimizer: SOAP's rounds depend on its step count (a basis refresh every
#: second step), which the failing member had counted before it failed; Shampoo's too (factors on
#: both sides of the ``12 × 200`` weight: its gathers, and a decomposition in the failed step).
