"""Tensor parallelism, then FSDP2, applied to a module that declares its TP plan.

The contract: a module declares ``tensor_parallel_plan() -> {module name pattern: ParallelStyle}``
(names relative to itself). `compose` applies that plan on the mesh's ``tensor_parallel``
dimension, then ``fully_shard`` over its ``data_parallel`` dimension on every member of an
``nn.ModuleList`` or ``nn.ModuleDict`` (the transformer blocks, the experts inside them, so that
each one's parameters are gathered only while it runs) and on every top-level submodule with
parameters. Units are sharded bottom-up (experts before their block), as FSDP2 requires;
containers without a ``forward`` of their own are never units, and modules FSDP2 already manages
are left as they are. Parameters set on ``module`` itself stay plain tensors (FSDP2 cannot manage
them: Lightning calls ``training_step``, not ``module.forward``); `CanzonaStrategy` keeps their
replicas equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


def compose(
    module: nn.Module, device_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> None:
    """Parallelize ``module`` in place on a ``(data_parallel, tensor_parallel)`` mesh.

    Args:
        module: The model (a LightningModule, or any module).
        device_mesh: A mesh with ``data_parallel`` and ``tensor_parallel`` dimensions.
        mp_policy: FSDP2's mixed precision for every unit (``None``: compute, all-gather and
            reduce in the parameters' dtype).

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
    options = {} if mp_policy is None else {"mp_policy": mp_policy}
    for unit in _units(module):
        fully_shard(unit, mesh=device_mesh["data_parallel"], **options)


def _check_plan_targets(module: nn.Module, plan: dict[str, Any]) -> None:
    names = [name for name, _ in module.named_modules()]
    missing = [key for key in plan if not any(fnmatchcase(name, key) for name in names)]
    if missing:
        raise ValueError(
            f"The tensor_parallel_plan() of {type(module).__name__} names modules that do not exist: "
            f"{missing}. Module names look like {names[1:4]}…"
        )


def _units(module: nn.Module) -> list[nn.Module]:
    """What to ``fully_shard``, children before their parents."""
    from torch.distributed.fsdp import FSDPModule

    candidates = {id(child) for child in module.children()}
    for container in module.modules():
        if isinstance(container, _CONTAINERS):
            candidates.update(id(member) for member in container.children())
    return [
        unit
        for unit in _post_order(module, set())
        if id(unit) in candidates
        and not isinstance(unit, (*_CONTAINERS, FSDPModule))
        and _has_parameters(unit)
    ]


#: Modules that only hold others and have no ``forward``: FSDP2 cannot hook them.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    """Every submodule once (a shared one at its first place), each after all its descendants."""
    for child in module.children():
        if id(child) not in seen:
            seen.add(id(child))
            yield from _post_order(child, seen)
            yield child


def _has_parameters(module: nn.Module) -> bool:
    return next(iter(module.parameters()), None) is not None
