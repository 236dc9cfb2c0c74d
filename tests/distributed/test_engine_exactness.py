"""The distributed engine equals the single-process optimizer on the full matrices.

Each mesh runs in one process group; inside it every optimizer × policy × α combination (with
overlap, and one without) steps a model parallelized with ``parallelize_module`` (TP) and
``fully_shard`` (FSDP2), fed the same full gradients as a single-process reference on plain
tensors, in float32 compute.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from multiprocess import DEVICE, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import lightning_canzona as lc
from lightning_canzona.optim import MatrixOptimizer

MESHES = {
    "dp2": ((2,), ("dp",)),
    "dp4": ((4,), ("dp",)),
    "tp2": ((2,), ("tp",)),
    "dp2xtp2": ((2, 2), ("dp", "tp")),
    # HSDP: FSDP2 replicates over "replicate" and shards over "dp"; the plan is replicated on
    # each replica, or spread over both with each result sent to both.
    "rep2xdp2": ((2, 2), ("replicate", "dp")),
    "rep2xtp2": ((2, 1, 2), ("replicate", "dp", "tp")),
}
OPTIMIZERS = {
    "muon": (lc.Muon, {"lr": 0.02, "compute_dtype": "float32", "adamw_lr": 1e-2}),
    "normuon": (lc.NorMuon, {"lr": 0.02, "compute_dtype": "float32", "adamw_lr": 1e-2, "beta2": 0.9}),
    "shampoo": (lc.Shampoo, {"lr": 1e-2, "precondition_frequency": 2, "start_preconditioning_step": 2}),
    # The authors' decay order: its first-step skip and its group step count, on every mesh.
    "soap": (lc.SOAP, {"lr": 1e-2, "precondition_frequency": 2, "weight_decay_order": "update_first"}),
}
PLANS = [
    # Every matrix a micro-group of its own: under sync each rank computes a stack's matrices
    # before it prepares the ones it holds.
    {"policy": "sync", "micro_group_capacity": 1.0},
    {"policy": "round_robin"},
    {"policy": "lpt"},
    {"policy": "canzona", "alpha": 0.0},
    {"policy": "canzona", "alpha": 0.5},
    # A budget this tight cuts a micro-group per matrix a rank computes: many groups in flight in
    # one arena, a stack's matrices prepared and computed in different groups.
    {"policy": "canzona", "alpha": 1.0, "memory_budget": 0.01},
]
STEPS = 3  # a None gradient at step 1, a lost block at step 2 (0-based)
ROW_BLOCKS = {"qkv.weight": (10, 6, 6), "experts.gate_up": 2}


class MixtureExperts(nn.Module):
    """Stacks of 5 expert matrices: FSDP2 splits them on the expert dimension, 3 + 2 over 2 ranks
    and 2 + 2 + 1 + 0 over 4, so that each expert lies whole on one rank. ``gate_up`` is fused:
    each expert is updated as two halves (`ROW_BLOCKS`); under TP it is packed as transformers
    packs its gate/up experts: rows 0–3 and 4–7 are split separately (``_StridedShard``), so each
    TP rank holds two row blocks of every expert."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 12, 9) / 3)
        self.gate_up = nn.Parameter(torch.randn(5, 8, 9) / 3)


class Net(nn.Module):
    """Uneven shapes: 130 and 17 rows over 2 or 4 ranks, and 3 rows over 4 (an empty shard); a
    convolution's weight, updated as the matrix ``6 × (4·3·3)``, 6 rows over 4 ranks.

    ``qkv`` is a fused GQA-like projection, updated block by block (`ROW_BLOCKS`): under TP its
    rows are split 11 + 11, across its blocks' boundaries, and its blocks' learning-rate scales
    differ (the 10-row block is taller than wide, the others are not).
    """

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(9, 22, bias=False)
        self.up = nn.Linear(70, 130)
        self.down = nn.Linear(130, 70)
        self.side = nn.Linear(33, 17, bias=False)
        self.tiny = nn.Linear(5, 3, bias=False)
        self.norm = nn.LayerNorm(70)
        self.experts = MixtureExperts()
        self.conv = nn.Conv2d(4, 6, 3, bias=False)


def _parallelize(model: Net, mesh) -> Net:
    names = mesh.mesh_dim_names
    if "tp" in names:
        tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
        plan = {
            "qkv": ColwiseParallel(),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(),
            "side": ColwiseParallel(),
        }
        parallelize_module(model, tp_mesh, plan)
        packed = [_StridedShard(1, split_factor=2)]
        gate_up = distribute_tensor(model.experts.gate_up.detach(), tp_mesh, packed, src_data_rank=None)
        model.experts.gate_up = nn.Parameter(gate_up)
    if "replicate" in names:
        fully_shard(model, mesh=mesh["replicate", "dp"])
    elif "dp" in names:
        fully_shard(model, mesh=mesh["dp"] if mesh.ndim > 1 else mesh)
    return model


def _gradients(step: int, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(1000 + step)
    grads = {name: torch.randn(shape, generator=generator).to(DEVICE) for name, shape in shapes.items()}
    if step == 1:
        grads["side.weight"] = None  # no rank has it: the step skips it, as on one device
    return grads


def _groups(model: Net) -> list[dict]:
    """The model's param groups, two of them with their own learning rate and weight decay (a
    step applies each group's updates in one call, with that group's settings); the matrices'
    learning rate is a tensor, as torch.optim takes it."""
    groups = lc.matrix_param_groups(model, matrix=["conv.weight"], row_blocks=ROW_BLOCKS)
    groups[0].update(lr=torch.tensor(1.5e-2), weight_decay=0.05)
    groups[1].update(lr=5e-3, weight_decay=0.2)
    return groups


def _run_combination(rank: int, mesh, optimizer_name: str, plan: dict, overlap: bool) -> MatrixOptimizer:
    optimizer_class, kwargs = OPTIMIZERS[optimizer_name]
    torch.manual_seed(0)
    reference_model = Net().to(DEVICE)  # on the ranks' device, as the sharded model
    torch.manual_seed(0)
    model = _parallelize(Net().to(DEVICE), mesh)  # the same initial weights, sharded
    reference = optimizer_class(_groups(reference_model), **kwargs)
    optimizer = optimizer_class(_groups(model), **kwargs, plan=lc.PlanConfig(**plan, overlap=overlap))
    shapes = {name: p.shape for name, p in reference_model.named_parameters()}
    params = dict(model.named_parameters())
    for step in range(STEPS):
        full_grads = _gradients(step, shapes)
        for name, param in params.items():
            grad = full_grads[name]
            if isinstance(param, DTensor) and grad is not None:
                param.grad = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
            else:
                param.grad = grad
        if step == 2 and "replicate" not in mesh.mesh_dim_names:  # (HSDP's replicas agree on gradients)
            # Rank 0 lost its block of up.weight: the engine sends zeros for it, which the
            # reference sees as a full gradient with that block zeroed.
            local = params["up.weight"].grad.to_local()
            mask = DTensor.from_local(
                torch.full_like(local, float(rank != 0)),
                params["up.weight"].device_mesh,
                params["up.weight"].placements,
                shape=shapes["up.weight"],
                stride=params["up.weight"].stride(),
            ).full_tensor()
            full_grads["up.weight"] = full_grads["up.weight"] * mask
            if rank == 0:
                params["up.weight"].grad = None
        for name, param in reference_model.named_parameters():
            param.grad = full_grads[name]
        optimizer.step()
        reference.step()
    label = f"{optimizer_name} {plan} overlap={overlap}"
    for name, expected in reference_model.named_parameters():
        actual = params[name]
        if isinstance(actual, DTensor):  # each rank checks its own shard of the reference
            # (torch 2.10 cannot gather a packed _StridedShard with full_tensor())
            expected = distribute_tensor(
                expected.detach(), actual.device_mesh, actual.placements, src_data_rank=None
            )
            actual, expected = actual.to_local(), expected.to_local()
        torch.testing.assert_close(
            actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{label}, {name}: {m}"
        )
    return optimizer


def _exactness_on_mesh(rank: int, world_size: int, mesh_name: str) -> None:
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh(DEVICE, shape, mesh_dim_names=names)
    # Overlap changes when micro-groups run, not what they move: every policy with it, one without.
    # On HSDP meshes, where the policies are the 2-D meshes' with replicas, one plan of each use
    # of the replicas.
    runs = [(plan, True) for plan in PLANS] + [({"policy": "canzona", "alpha": 0.5}, False)]
    if math.prod(shape) == 2:  # every policy on the 4-rank meshes; on 2 ranks, three of them
        runs = [({"policy": policy}, True) for policy in ("sync", "lpt", "canzona")]
    if "replicate" in names:
        runs = [({"policy": "canzona", "replicas": use}, True) for use in ("replicated", "spread")]
    for optimizer_name, (plan, overlap) in itertools.product(OPTIMIZERS, runs):
        optimizer = _run_combination(rank, mesh, optimizer_name, plan, overlap)
        if "replicas" in plan:  # each replica's plan over its own 2 ranks, or one over all 4
            (engine,) = optimizer.engines.values()
            assert (engine.replication.mode, engine.plan.num_ranks) == (
                plan["replicas"],
                2 if plan["replicas"] == "replicated" else 4,
            )
    dist.barrier()


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_distributed_step_equals_single_process(mesh_name: str) -> None:
    run_on_ranks(math.prod(MESHES[mesh_name][0]), _exactness_on_mesh, mesh_name)
