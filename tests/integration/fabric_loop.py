"""A Fabric training loop as a user writes it, which `test_fabric.py` launches on forked ranks
(and `test_multinode.py` as a SLURM job's script on two nodes): a model, ``fabric.setup(model,
optimizer)`` or ``setup_module`` then ``setup_optimizers``, gradient accumulation under
``no_backward_sync``, clipping, and the trained weights gathered whole; and the same loop in one
process, the reference.
"""

from __future__ import annotations

import sys

import pytest
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


def one_process(model_name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float]]:
    """The loop in one process, without Fabric: the initial and trained weights, the norms."""
    model = build(model_name)
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = lc.Muon(lc.matrix_param_groups(model), **MUON)
    norms = []
    for micro_batches in batches().split(ACCUMULATE):
        for tokens in micro_batches:
            loss_of(model, tokens).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return initial, model.state_dict(), norms


def check_against_one_process(trained: dict, tensor_parallel: bool, model_name: str = "qwen3") -> None:
    """``trained`` (`train`'s result) equals `one_process` within float32's bounds."""
    initial, expected, expected_norms = one_process(model_name)
    # The norms before clipping (clipping fired: they exceed MAX_NORM), then the weights, with the
    # bounds of the transformers tests: data parallelism alone reorders no sum; tensor
    # parallelism sums partial products in another order, float32 noise Newton-Schulz amplifies.
    assert min(expected_norms) > MAX_NORM
    assert trained["norms"] == pytest.approx(expected_norms, rel=1e-5)
    tolerance = 3e-5 if tensor_parallel else 1e-6
    ulps = 16 * torch.finfo(torch.float32).eps
    assert trained["weights"].keys() == expected.keys()
    for name, weight in expected.items():
        update, expected_update = trained["weights"][name] - initial[name], weight - initial[name]
        bound = tolerance * float(expected_update.norm()) + ulps * float(initial[name].norm())
        assert float((update - expected_update).norm()) <= bound, name


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


if __name__ == "__main__":  # under srun or torchrun: fabric_loop.py RESULT NUM_NODES DEVICES REPLICAS|auto
    nodes, devices = map(int, sys.argv[2:4])
    replicas = sys.argv[4] if sys.argv[4] == "auto" else int(sys.argv[4])
    strategy = lc.CanzonaFabricStrategy(data_parallel_replicate_size=replicas)
    fabric = Fabric(strategy=strategy, accelerator="cpu", num_nodes=nodes, devices=devices)
    fabric.launch()
    result = train(fabric, "separate")
    if fabric.global_rank == 0:
        torch.save(result, sys.argv[1])
