"""A rule written outside the package (`examples/rules/adafactor.py`) plans, runs exactly, saves
and loads at another mesh, with nothing in the package changed for it."""

from __future__ import annotations

import sys
from pathlib import Path

import test_engine_exactness as exactness
import torch
import torch.distributed as dist
from multiprocess import DEVICE, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_canzona as lc
from lightning_canzona.checkpoint import load_distributed, write_state
from lightning_canzona.checkpoint.state import full_model_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "rules"))
from adafactor import Adafactor  # noqa: E402  (an example, not a package)

SETTINGS = {"lr": 1e-2, "weight_decay": 0.1, "beta2": 0.9, "adamw_lr": 1e-2}


def _exact_on_dp2_tp2(rank: int, world_size: int) -> None:
    # The engine's exactness test, its model and its checks, with the example's optimizer in it:
    # uneven shapes, an empty shard, expert stacks, row blocks, None and lost gradients, every
    # policy, with and without overlap.
    exactness.OPTIMIZERS["adafactor"] = (Adafactor, SETTINGS)
    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    for plan in exactness.PLANS:
        for overlap in (True, False):
            exactness._run_combination(rank, mesh, "adafactor", plan, overlap)
    dist.barrier()


def test_an_own_rule_runs_exactly_at_dp2_tp2() -> None:
    run_on_ranks(4, _exact_on_dp2_tp2)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 40, bias=False)
        self.down = nn.Linear(40, 24, bias=False)
        self.side = nn.Linear(24, 10, bias=False)
        self.norm = nn.LayerNorm(24)


def _model(mesh) -> Small:
    torch.manual_seed(0)
    model = Small().to(DEVICE)
    if "tp" in mesh.mesh_dim_names:
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel(), "side": ColwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    return model


def _step(model: Small, optimizer: Adafactor, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in model.parameters():
        grad = torch.randn(param.shape, generator=generator).to(DEVICE)
        param.grad = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
    optimizer.step()


def _train(rank: int, world_size: int, shape: tuple[int, int], checkpoint: str, out: str) -> None:
    """Four steps at ``shape``: saving after two (``out`` ending in ``uninterrupted``) or loading
    the checkpoint and running the last two; rank 0 saves the weights whole."""
    mesh = init_device_mesh(DEVICE, shape, mesh_dim_names=("dp", "tp"))
    model = _model(mesh)
    optimizer = Adafactor(lc.matrix_param_groups(model), **SETTINGS)
    resumed = not out.endswith("uninterrupted.pt")
    if resumed:
        load_distributed(Path(checkpoint), model, {"optimizer": optimizer}, model_key="model")
    for step in range(2 if resumed else 0, 4):
        _step(model, optimizer, step)
        if step == 1 and not resumed:
            write_state(Path(checkpoint), {"model": model, "optimizer": optimizer}, model, distributed=True)
    # Each matrix's row and column means live on one owner: 3 matrices, 3 holders over the ranks.
    held = torch.tensor(
        sum("row" in optimizer.state[p] for p in model.parameters() if p.ndim == 2), device=DEVICE
    )
    dist.all_reduce(held)
    assert int(held) == 3
    weights = full_model_state(model)
    if rank == 0:
        torch.save(weights, out)


def test_an_own_rule_saves_at_dp2_tp2_and_loads_at_dp4(tmp_path) -> None:
    checkpoint, uninterrupted, resumed = (
        tmp_path / "checkpoint",
        tmp_path / "uninterrupted.pt",
        tmp_path / "resumed.pt",
    )
    run_on_ranks(4, _train, (2, 2), str(checkpoint), str(uninterrupted))
    run_on_ranks(4, _train, (4, 1), str(checkpoint), str(resumed))
    expected, actual = torch.load(uninterrupted), torch.load(resumed)
    for name, weight in expected.items():
        # Whole matrices on their owners at both meshes: the same arithmetic (measured: equal bit
        # for bit; resumed without the optimizer's state, 0.009 to 0.013 apart).
        torch.testing.assert_close(actual[name], weight, rtol=1e-6, atol=1e-7, msg=name)
