"""A Fabric training loop as a user writes it, which `test_fabric.py` launches on forked ranks: a
model, ``fabric.setup(model, optimizer)`` or ``setup_module`` then ``setup_optimizers``, gradient
accumulation under ``no_backward_sync``, clipping, and the trained weights gathered whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.distributed.device_mesh import DeviceMesh

import lightning_canzona as lc
from lightning_canzona.checkpoint.state import full_model_state
from lightning_canzona.models.qwen3 import Qwen3

STEPS, ACCUMULATE, BATCH, SEQ, MAX_NORM = 3, 2, 4, 33, 0.5
MUON = {"lr": 0.02, "adamw_lr": 3e-3, "weight_decay": 0.01, "compute_dtype": "float32"}


def batches() -> torch.Tensor:
    """Every micro-batch of the run: the same on every rank and in the one-process reference."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(256, (STEPS * ACCUMULATE, BATCH, SEQ), generator=generator)


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    output = model(tokens[:, :-1])
    logits = getattr(output, "logits", output)  # a transformers model returns them in its output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)) / ACCUMULATE


def build(model: str) -> torch.nn.Module:
    """The model, from the seed every run sets."""
    torch.manual_seed(0)
    if model == "qwen3":
        return Qwen3("tiny")
    import transformers  # a test dependency: a third-party model, random weights, nothing downloaded

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def parallelize_mlps(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """What a user writes who keeps attention whole on the TP ranks (as for litgpt's fused QKV, which
    splits heads by the global head count): tensor parallelism for the MLPs, FSDP2 per layer."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mlp_plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer.mlp, mesh["tensor_parallel"], mlp_plan)
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def train(fabric: Fabric, setup: str, model_name: str = "qwen3") -> dict[str, object]:
    """The loop, on the ranks that ``fabric`` launched; rank 0 returns the trained weights whole,
    the gradient norms before each clipping and the shapes of the meshes the optimizer planned."""
    model = build(model_name)
    if setup == "joint":  # the optimizer built on the parameters before they are sharded
        model, optimizer = fabric.setup(model, lc.Muon(lc.matrix_param_groups(model), **MUON))
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(lc.Muon(lc.matrix_param_groups(model), **MUON))
    norms = []
    for micro_batches in batches().split(ACCUMULATE):
        for index, tokens in enumerate(micro_batches):
            with fabric.no_backward_sync(model, enabled=index < ACCUMULATE - 1):
                fabric.backward(loss_of(model, tokens))
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    meshes = [tuple(mesh.shape) for mesh in optimizer.plans()]
    return {"weights": full_model_state(model), "norms": norms, "meshes": meshes}
