"""What teams' collectives and each dtype's FLOPs cost the planner: an H100's, or measured on
the job's own ranks."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
from free_teams import FREE_TEAMS
from multiprocess import DEVICE, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import lightning_canzona as lc
from lightning_canzona.distributed.prices import measure_team_costs, priced
from lightning_canzona.planning import PlanSettings
from lightning_canzona.rules.blocks import RowBlockRule
from lightning_canzona.rules.muon import DTYPES, MuonRule
from lightning_canzona.rules.newton_schulz import (
    PRESETS,
)
from lightning_canzona.rules.shampoo import ShampooRule
from lightning_canzona.rules.soap import SOAPRule
from lightning_canzona.tools.simulation import H100


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
    prices = measure_team_costs(device=DEVICE)
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
    mesh = init_device_mesh(DEVICE, (world_size,))
    shapes = [(8, 16), (12, 10), (8, 16)]
    weights = [
        nn.Parameter(
            distribute_tensor(torch.randn(shape, device=DEVICE), mesh, [Shard(0)], src_data_rank=None)
        )
        for shape in shapes
    ]

    def muon(team_prices):
        groups = [
            {"params": weights[:1], "compute_dtype": "bfloat16"},
            {"params": weights[1:2], "compute_dtype": "float32"},
            {"params": weights[2:], "compute_dtype": "float64"},
        ]
        return lc.Muon(groups, lr=0.02, plan=lc.PlanConfig(team_prices=team_prices))

    for weight in weights:
        weight.grad = distribute_tensor(
            torch.randn(weight.shape, device=DEVICE), mesh, [Shard(0)], src_data_rank=None
        )
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
    mesh = init_device_mesh(DEVICE, (world_size,))
    torch.manual_seed(0)
    initial, grads = (
        torch.randn(12, 20, device=DEVICE),
        [torch.randn(12, 20, device=DEVICE) for _ in range(3)],
    )
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
