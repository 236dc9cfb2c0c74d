"""Gradient clipping by norm across parameters that live on different device meshes.

``torch.nn.utils.clip_grad_norm_`` stacks every gradient's norm into one tensor, which fails when
DTensors live on different meshes (a 2-D DP×TP mesh for the blocks, a 1-D DP mesh for the
embedding): DTensor refuses to mix them. Here each mesh's norm is reduced on its own mesh, and the
per-mesh norms, now plain tensors, are combined.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_canzona.distributed.gradients import agree_on_gradients


def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all gradients together, as a plain tensor on every rank.

    The ranks first agree on the gradients (`agree_on_gradients`), so that every rank takes
    part in the same per-mesh reductions even where its own gradient is ``None`` or laid out
    differently.
    """
    parameters = list(parameters)
    agree_on_gradients([(f"parameters[{i}]", p) for i, p in enumerate(parameters)], check_finite=False)
    by_mesh: dict[object, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    stacked = torch.stack([norm.float().cpu() for norm in norms])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """Scale all gradients so that their total norm is at most ``max_norm``; return the norm.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite (on every rank: the
            norm is agreed), before any gradient changes, as ``torch.nn.utils.clip_grad_norm_``.
    """
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite ({float(total)}): "
            "nothing was clipped. Pass error_if_nonfinite=False to clip anyway."
        )
    coefficient = float(max_norm) / (float(total) + 1e-6)
    if coefficient < 1.0:
        for param in parameters:
            if param.grad is not None:
                param.grad.mul_(coefficient)
    return total
