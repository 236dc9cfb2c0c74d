"""Gradient clipping by norm across parameters that live on different device meshes.

``torch.nn.utils.clip_grad_norm_`` fails where DTensors live on different meshes; here each mesh's
norm is reduced on its own mesh and the per-mesh norms combined. Given the optimizer's
`GradientAgreement`, clipping adds no read of the device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_canzona.compat import foreach_mul_
from lightning_canzona.distributed.agreement import Agreement, GradientAgreement
from lightning_canzona.distributed.layout import local_tensor


def agreement_of(optimizer: object) -> GradientAgreement | None:
    """The `GradientAgreement` of ``optimizer`` (a lightning_canzona optimizer's), else ``None``."""
    agreement = getattr(optimizer, "agreement", None)
    return agreement if isinstance(agreement, GradientAgreement) else None


@contextmanager
def _agreement_for(agreement: GradientAgreement | None) -> Iterator[GradientAgreement]:
    """``agreement``, or one of the clipping's own, whose checks are read when it ends."""
    if agreement is not None:
        yield agreement
        return
    own = GradientAgreement()
    yield own
    own.settle()


def total_grad_norm(
    parameters: Iterable[Tensor], norm_type: float = 2.0, agreement: GradientAgreement | None = None
) -> Tensor:
    """The ``norm_type``-norm of all gradients together, as a plain tensor on every rank's device,
    once the ranks agree on the gradients (with ``agreement``, the optimizer's that steps next, or
    their own), so that every rank joins the same per-mesh reductions."""
    parameters = list(parameters)
    with _agreement_for(agreement) as agreed:
        _agree(agreed, parameters)
    return _norm(parameters, norm_type)


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    agreement: GradientAgreement | None = None,
) -> Tensor:
    """Scale all gradients so that their total norm is at most ``max_norm``; return the norm.

    As ``torch.nn.utils.clip_grad_norm_`` (the factor ``max_norm / (norm + 1e-6)``, at most 1; a NaN
    norm clips nothing). ``agreement``: the `GradientAgreement` of the optimizer that steps next
    (``optimizer.agreement``), which then takes the clipping's agreement over.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite, on every rank before any
            gradient changes (or, where the agreement cannot foresee it, at the next agreement).
    """
    parameters = list(parameters)
    with _agreement_for(agreement) as agreed:
        facts = _agree(agreed, parameters)
        total = _norm(parameters, norm_type)
        coefficient = max_norm / (total + 1e-6)
        clips = coefficient < 1.0  # False for a NaN norm: nothing is clipped
        if error_if_nonfinite:
            if any(facts.non_finite) or (norm_type == 2.0 and any(facts.overflows)):
                raise RuntimeError(_non_finite(norm_type, float(total)))  # failing anyway: the read is free
            # What the agreement cannot foresee (another order's overflow, squares that overflow
            # only summed over ranks): nothing is clipped, and the next agreement raises.
            finite = torch.isfinite(total)
            clips &= finite
            agreed.defer(~finite, functools.partial(_raise_if_non_finite, norm_type))
        grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
        if grads:
            foreach_mul_(grads, torch.where(clips, coefficient, 1.0))
            agreed.keep()  # scaled by a factor in [0, 1]: what the ranks agreed on still holds
    return total


def _agree(agreement: GradientAgreement, parameters: list[Tensor]) -> Agreement:
    return agreement.agree([(f"parameters[{i}]", p) for i, p in enumerate(parameters)])


def _norm(parameters: list[Tensor], norm_type: float) -> Tensor:
    """The norm of the agreed gradients of ``parameters``, each mesh's reduced on its mesh."""
    by_mesh: dict[object, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        device = local_tensor(parameters[0]).device if parameters else None
        return torch.zeros((), device=device)
    stacked = torch.stack([norm.float().to(norms[0].device) for norm in norms])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def _non_finite(norm_type: float, total: float | str) -> str:
    return (
        f"The total norm of order {norm_type} of the gradients is non-finite ({total}): "
        "nothing was clipped. Pass error_if_nonfinite=False to clip anyway."
    )


def _raise_if_non_finite(norm_type: float, flags: list[float]) -> None:
    if flags[0]:
        raise RuntimeError(_non_finite(norm_type, "nan or inf"))
