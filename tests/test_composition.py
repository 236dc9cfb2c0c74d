"""`compose` on the module trees users bring, and FSDP2's mixed precision under ``bf16-mixed``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning import Callback, Trainer
from multiprocess import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import lightning_canzona as lc
from lightning_canzona.composition import compose
from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.models import CausalLanguageModel


class MixtureBlock(nn.Module):
    """A router and a ModuleList of experts: a ModuleList nested in a ModuleList member."""

    def __init__(self, width: int = 8, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 16), nn.SiLU(), nn.Linear(16, width)) for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(dim=-1)
        return x + sum(weights[..., i : i + 1] * expert(x) for i, expert in enumerate(self.experts))


class Tree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MixtureBlock() for _ in range(2))
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 4), "b": nn.Linear(8, 4)})
        self.scale = nn.Parameter(torch.ones(()))  # on the root: FSDP2 cannot manage it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.scale * (self.heads["a"](x) + self.heads["b"](x))


def _compose_trees(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    model = Tree()
    fully_shard(model.blocks[0].experts[0], mesh=mesh["data_parallel"])  # the user sharded one already
    compose(model, mesh)
    units = [*model.blocks, *model.blocks[1].experts, *model.heads.values()]
    assert all(isinstance(unit, FSDPModule) for unit in units)
    assert not isinstance(model.blocks, FSDPModule) and not isinstance(model.heads, FSDPModule)
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert plain == ["scale"]
    optimizer = lc.Muon(lc.matrix_param_groups(model), compute_dtype="float32")
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(
        torch.isfinite(p.full_tensor() if isinstance(p, DTensor) else p).all() for p in model.parameters()
    )
    dist.barrier()


def test_compose_shards_module_lists_dicts_and_nested_experts_bottom_up() -> None:
    run_on_ranks(2, _compose_trees)


class CheckMixedPrecision(Callback):
    """bf16 in the forward; float32 shards, gradients and optimizer under ``bf16-mixed``."""

    def setup(self, trainer, pl_module, stage) -> None:
        self.seen: list[torch.dtype] = []
        up_proj = pl_module.model.layers[0].mlp.up_proj
        up_proj.register_forward_pre_hook(lambda module, args: self.seen.append(module.weight.dtype))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        weight = pl_module.model.layers[0].mlp.up_proj.weight
        assert isinstance(weight, DTensor) and weight.dtype == torch.float32
        assert weight.grad.dtype == torch.float32
        assert self.seen and set(self.seen) == {torch.bfloat16}


def test_bf16_mixed_gathers_and_computes_in_bf16_and_reduces_in_float32() -> None:
    trainer = Trainer(
        strategy=lc.CanzonaStrategy(data_parallel_size=2, tensor_parallel_size=1, start_method="spawn"),
        accelerator="cpu",
        devices=2,
        precision="bf16-mixed",
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CheckMixedPrecision()],
    )
    trainer.fit(CausalLanguageModel(preset="tiny"), datamodule=ByteTextDataModule(seq_len=32, batch_size=4))
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
