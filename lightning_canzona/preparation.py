"""What the Trainer strategy and the Fabric strategy both do to a model and its optimizers.

`CanzonaStrategy` (``Trainer``) and `CanzonaFabricStrategy` (``Fabric``) are thin adapters: each
calls these at the moment its framework gives it the model, the optimizers or the backward pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_canzona.compat import flatten_mesh
from lightning_canzona.composition import sharding_mesh
from lightning_canzona.config import PlanConfig
from lightning_canzona.distributed.agreement import (
    GradientAgreement,
    average_gradients,
    check_gradients_agree,
)
from lightning_canzona.mesh import MeshShape, Size, auto_replicas
from lightning_canzona.optim import MatrixOptimizer
from lightning_canzona.optim.binding import bind_optimizer
from lightning_canzona.planning import report
from lightning_canzona.qk_clip_runtime import attach_qk_clip
from lightning_canzona.rules.blocks import describe_row_blocks

NamedParameters = list[tuple[str, nn.Parameter]]


def decide_replicas(
    shape: MeshShape, setting: Size, num_nodes: int, module: nn.Module | None, device: torch.device
) -> MeshShape:
    """``shape`` with ``data_parallel_replicate_size=setting`` decided where it is ``"auto"``
    (`lightning_canzona.mesh.auto_replicas`), on the ranks: collective, they agree on the least
    memory a node has (a GPU's times the devices on a node; the host's on the CPU)."""
    if setting != "auto" or num_nodes == 1:
        return shape
    if device.type == "cuda":
        per_node = torch.cuda.get_device_properties(device).total_memory * (
            dist.get_world_size() // num_nodes
        )
    else:
        per_node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    least = torch.tensor(per_node, dtype=torch.int64, device=device)  # NCCL takes no host tensor
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    parameters = sum(p.numel() for p in module.parameters()) if module is not None else 0
    shape = auto_replicas(shape, num_nodes, parameters, int(least.item()))
    rank_zero_info(shape.describe())
    return shape


def build_device_mesh(shape: MeshShape, device: torch.device) -> DeviceMesh:
    """The device mesh of ``shape`` on ``device``'s type: Lightning's ``(data_parallel,
    tensor_parallel)``, or with replicas (HSDP) ``(data_parallel_replicate, data_parallel_shard,
    tensor_parallel)``, whose first two are also ``data_parallel`` (flattened: what the data
    sampler, metrics and reductions split the data over)."""
    from torch.distributed.device_mesh import init_device_mesh

    dimensions = shape.dimensions()
    mesh = init_device_mesh(device.type, tuple(dimensions.values()), mesh_dim_names=tuple(dimensions))
    if shape.replicate_size > 1:
        flatten_mesh(sharding_mesh(mesh), "data_parallel")
    return mesh


def share_cpu_cores(device: torch.device, processes: int) -> None:
    """Ranks on one CPU share its cores: give each its share of threads, unless the user set
    ``OMP_NUM_THREADS`` (oversubscribed threads would fight each other)."""
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


def check_not_fsdp1(module: nn.Module, strategy: str) -> None:
    """A `TypeError` for a module wrapped with FSDP1, which neither strategy composes with."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(child, FullyShardedDataParallel) for child in module.modules()):
        raise TypeError(
            "Found modules wrapped with torch.distributed.fsdp.FullyShardedDataParallel (FSDP1); "
            f"{strategy} shards with FSDP2 (fully_shard). Remove the FSDP1 wrapping."
        )


def unsharded_parameters(module: nn.Module, data_parallel: DeviceMesh, world_size: int) -> NamedParameters:
    """The trainable parameters of ``module`` whose gradients nothing reduces over the
    ``data_parallel`` mesh, which the strategy synchronises (`synchronise_unsharded`); says which,
    once, where there are any.

    Those are the plain tensors, and the DTensors whose mesh leaves out this rank's data-parallel
    group (DTensor reduces a gradient over its own mesh only): a tensor-parallel weight that FSDP2
    does not shard, one tied across two FSDP2 units (`lightning_canzona.composition`). The ranks
    tell, not the mesh's dimension names, which a ``configure_model`` may choose.
    """
    replicas = set(data_parallel.mesh.flatten().tolist())
    named = [
        (name, param)
        for name, param in module.named_parameters()
        if param.requires_grad
        and not (isinstance(param, DTensor) and replicas <= set(param.device_mesh.mesh.flatten().tolist()))
    ]
    if named and world_size > 1:
        names = [name for name, _ in named]
        rank_zero_info(
            f"lightning_canzona: {len(names)} trainable parameters are not sharded over data "
            f"parallelism ({names[:5]}{' …' if len(names) > 5 else ''}): their gradients are "
            "averaged over the data-parallel group after each backward."
        )
    return named


def synchronise_unsharded(
    named: NamedParameters, group: dist.ProcessGroup, agreement: GradientAgreement | None
) -> None:
    """Average the gradients of ``named`` over the data-parallel ``group`` and check that they
    agree on every rank (`lightning_canzona.distributed.agreement`).

    What the device knows of them waits for ``agreement`` (`step_agreement`), the next step's;
    without one it is read now.
    """
    checks = GradientAgreement() if agreement is None else agreement
    average_gradients([param for _, param in named], group, checks)
    check_gradients_agree(named, checks)
    if agreement is None:
        checks.settle()


def step_agreement(optimizers: Sequence[Optimizer]) -> GradientAgreement | None:
    """The agreement of the optimizer whose step reads the checks of every backward: the only
    optimizer, where it is a `MatrixOptimizer`; ``None`` where there are several (a step of one
    would read checks about another's gradients) or the one has none."""
    if len(optimizers) == 1 and isinstance(optimizers[0], MatrixOptimizer):
        return optimizers[0].agreement
    return None


@contextmanager
def without_gradient_sync(module: nn.Module | None) -> Iterator[None]:
    """Within the block, FSDP2 skips its gradients' reduce-scatter (micro-batches that
    accumulate: the unsharded gradients stay on each rank until the last one)."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in module.modules() if isinstance(m, FSDPModule)] if module is not None else []
    for fsdp in modules:
        fsdp.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for fsdp in modules:
            fsdp.set_requires_gradient_sync(True, recurse=False)


def bind_and_describe(
    optimizer: Optimizer,
    module: nn.Module,
    config: PlanConfig | None,
    schedulers: Sequence[LRScheduler] = (),
    source: str = "CanzonaStrategy",
    devices_per_node: int | None = None,
) -> Optimizer:
    """``optimizer`` bound to the strategy (`bind_optimizer`), its plan built and printed as a
    table per mesh, its row blocks named, and its QK-clip attached to ``module`` with its cost
    (collective: the plan shares the shards' layouts). ``devices_per_node`` prices the plan's
    gathers and scatters within or across nodes (`MatrixOptimizer.devices_per_node`)."""
    bound, message = bind_optimizer(optimizer, module, config, schedulers, source)
    if message:
        rank_zero_info(message)
    if isinstance(bound, MatrixOptimizer):
        bound.devices_per_node = devices_per_node
        for mesh, plan in bound.plans().items():
            if plan.matrices:  # a mesh of AdamW parameters only has nothing to show
                text = f"lightning_canzona plan on mesh {tuple(mesh.shape)}:\n{report(plan).table()}"
                replication = bound.engines[mesh].replication
                if replication is not None:
                    text += "\n" + replication.describe(plan.num_ranks)
                rank_zero_info(text)
        if bound.row_blocks():
            rank_zero_info(f"lightning_canzona: {describe_row_blocks(bound.row_blocks())}")
        if bound.qk_clip is not None:
            rank_zero_info(attach_qk_clip(module, bound).describe())
    return bound
