"""`compose` on the module trees users bring, and FSDP2's mixed precision under ``bf16-mixed``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning import Callback, LightningModule, Trainer
from multiprocess import DEVICE, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_canzona as lc
from lightning_canzona.composition import compose


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
    mesh = init_device_mesh(DEVICE, (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    model = Tree().to(DEVICE)
    fully_shard(model.blocks[0].experts[0], mesh=mesh["data_parallel"])  # the user sharded one already
    compose(model, mesh)
    units = [*model.blocks, *model.blocks[1].experts, *model.heads.values()]
    assert all(isinstance(unit, FSDPModule) for unit in units)
    assert not isinstance(model.blocks, FSDPModule) and not isinstance(model.heads, FSDPModule)
    plain = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert plain == ["scale"]
    optimizer = lc.Muon(lc.matrix_param_groups(model), compute_dtype="float32")
    for _ in range(2):
        model(torch.randn(4, 8, device=DEVICE)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(
        torch.isfinite(p.full_tensor() if isinstance(p, DTensor) else p).all() for p in model.parameters()
    )
    dist.barrier()


def test_compose_shards_module_lists_dicts_and_nested_experts_bottom_up() -> None:
    run_on_ranks(2, _compose_trees)


class GatedBlock(MixtureBlock):
    """A mixture scaled by a learned scalar, which FSDP2 cannot shard (it shards a dimension)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * (super().forward(x) - x)


class Heads(nn.Module):
    """A container of the user's own, without ``forward``: its owner calls each head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)


class TiedTree(nn.Module):
    """Scalars in the blocks, a weight tied across two top-level children, sibling roots."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(2))
        self.unembed = nn.Linear(8, 8, bias=False)
        self.unembed.weight = self.embed.weight
        self.heads = Heads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        x = self.unembed(x)
        return self.heads.a(x) + self.heads.b(x)


def _plain(module: nn.Module) -> list[str]:
    return sorted(
        name for name, p in module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)
    )


def _units(module: nn.Module) -> set[str]:
    return {name for name, child in module.named_modules() if isinstance(child, FSDPModule)}


EXPERTS = {f"blocks.{block}.experts.{expert}" for block in range(2) for expert in range(3)}


def _compose_tied_tree(mesh) -> None:
    torch.manual_seed(0)  # the same weights and inputs on every rank
    model = TiedTree().to(DEVICE)
    compose(model, mesh)
    assert _units(model) == {"blocks.0", "blocks.1", "heads.a", "heads.b", *EXPERTS}
    # Sharding the tied weight in one unit would untie it from the other: it stays plain.
    assert _plain(model) == ["blocks.0.gate", "blocks.1.gate", "embed.weight"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    x = torch.randn(4, 8, device=DEVICE)
    for _ in range(2):
        loss = model(x).square().mean()
        # The blocks and heads are each an FSDP2 root: they still free their gathered parameters.
        assert _plain(model) == ["blocks.0.gate", "blocks.1.gate", "embed.weight"]
        loss.backward()
        for name, param in model.named_parameters():
            assert param.grad is not None and isinstance(param.grad, DTensor) == isinstance(param, DTensor), (
                name
            )
        optimizer.step()
        optimizer.zero_grad()
        assert torch.isfinite(loss)
    assert model.unembed.weight is model.embed.weight


def _compose_around_a_sharded_block(mesh) -> None:
    torch.manual_seed(0)
    model = TiedTree().to(DEVICE)
    gate = model.blocks[0].gate
    fully_shard(model.blocks[0], mesh=mesh["data_parallel"], ignored_params={gate})  # the user's own
    compose(model, mesh)
    # Inside the user's unit nothing is added: its experts are already DTensors on the DP mesh.
    assert _units(model) == {"blocks.0", "blocks.1", "heads.a", "heads.b", *EXPERTS} - {
        f"blocks.0.experts.{expert}" for expert in range(3)
    }
    model(torch.randn(4, 8, device=DEVICE)).square().mean().backward()
    assert all(param.grad is not None for param in model.parameters())


def _compose_scalars_ties_and_sharded_modules(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    _compose_tied_tree(mesh)
    _compose_around_a_sharded_block(mesh)
    dist.barrier()


def test_compose_leaves_scalars_and_cross_unit_ties_plain_and_sharded_modules_alone() -> None:
    run_on_ranks(2, _compose_scalars_ties_and_sharded_modules)


class MixtureModel(LightningModule):
    """Blocks set on the LightningModule itself (a top-level ModuleList), experts in each block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(2))
        self.head = nn.Linear(8, 8)
        self.temperature = nn.Parameter(torch.ones(1))  # on the LightningModule: stays plain

    def training_step(self, batch, batch_idx):
        x, target = batch
        for block in self.blocks:
            x = block(x)
        loss = F.mse_loss(self.head(x).float() * self.temperature, target)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 8, generator=generator))
        return DataLoader(data, batch_size=8)

    def configure_optimizers(self):
        return lc.Muon(lc.matrix_param_groups(self), lr=0.02, adamw_lr=0.01)


class CheckCompositionAndPrecision(Callback):
    """Every parameter sharded but the plain ones; bf16 in the forward, float32 everywhere else."""

    def on_fit_start(self, trainer, pl_module) -> None:  # after the strategy's setup
        assert _plain(pl_module) == ["blocks.0.gate", "blocks.1.gate", "temperature"]
        assert _units(pl_module) == {"blocks.0", "blocks.1", "head", *EXPERTS}
        self.seen: list[torch.dtype] = []
        linear = pl_module.blocks[0].experts[1][0]  # inside an expert's unit: gathered in forward
        linear.register_forward_pre_hook(lambda module, args: self.seen.append(module.weight.dtype))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        weight = pl_module.blocks[0].experts[1][0].weight
        assert isinstance(weight, DTensor) and weight.dtype == torch.float32
        assert isinstance(weight.grad, DTensor) and weight.grad.dtype == torch.float32
        assert self.seen and set(self.seen) == {torch.bfloat16}

    def on_train_end(self, trainer, pl_module) -> None:
        states = [v for state in trainer.optimizers[0].state.values() for v in state.values()]
        floats = [v for v in states if torch.is_tensor(v) and v.is_floating_point()]
        assert floats and all(v.dtype == torch.float32 for v in floats)


def test_fit_composes_a_mixture_and_bf16_mixed_gathers_in_bf16_and_reduces_in_float32() -> None:
    # "spawn" here (every other fit in the suite forks, which is faster): both start methods stay covered.
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
        callbacks=[CheckCompositionAndPrecision()],
    )
    trainer.fit(MixtureModel())
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
