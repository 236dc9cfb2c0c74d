"""Tensor parallelism, then FSDP2, applied to a module that declares its TP plan.

The contract: a module declares ``tensor_parallel_plan() -> {module name pattern: ParallelStyle}``
(names relative to itself). `compose` applies that plan on the mesh's ``tensor_parallel``
dimension, then ``fully_shard`` over its ``data_parallel`` dimension on every member of an
``nn.ModuleList`` (the transformer blocks, so each block's parameters are gathered only while it
runs) and on every top-level submodule with parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def compose(module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Parallelize ``module`` in place on a ``(data_parallel, tensor_parallel)`` mesh.

    Raises:
        ValueError: The TP mesh has more than one rank but the module declares no plan, or the
            plan names modules that do not exist.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    plan_fn = getattr(module, "tensor_parallel_plan", None)
    plan = plan_fn() if callable(plan_fn) else {}
    tp_mesh = device_mesh["tensor_parallel"]
    if tp_mesh.size() > 1 and not plan:
        raise ValueError(
            f"tensor_parallel_size={tp_mesh.size()} but {type(module).__name__} declares no "
            "tensor_parallel_plan(); add one (see lightning_canzona.models.tensor_parallel_plan) "
            "or override configure_model to parallelize it yourself."
        )
    if plan:
        # Applied even on a one-rank TP mesh: parameters then live on the same meshes at every
        # mesh shape, so optimizer param groups, and checkpoints, keep one structure.
        _check_plan_targets(module, plan)
        parallelize_module(module, tp_mesh, plan)
    dp_mesh = device_mesh["data_parallel"]
    for block in _transformer_blocks(module):
        fully_shard(block, mesh=dp_mesh)
    for child in module.children():
        if _has_parameters(child):
            fully_shard(child, mesh=dp_mesh)


def _check_plan_targets(module: nn.Module, plan: dict[str, Any]) -> None:
    names = [name for name, _ in module.named_modules()]
    missing = [key for key in plan if not any(fnmatchcase(name, key) for name in names)]
    if missing:
        raise ValueError(
            f"The tensor_parallel_plan() of {type(module).__name__} names modules that do not exist: "
            f"{missing}. Module names look like {names[1:4]}…"
        )


def _transformer_blocks(module: nn.Module) -> Iterator[nn.Module]:
    """Members of every ``nn.ModuleList``: the repeated blocks FSDP2 should shard one by one."""
    for child in module.modules():
        if isinstance(child, nn.ModuleList):
            yield from (block for block in child if _has_parameters(block))


def _has_parameters(module: nn.Module) -> bool:
    return next(iter(module.parameters()), None) is not None
