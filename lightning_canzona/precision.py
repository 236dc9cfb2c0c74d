"""Lightning precision plugins under the strategies: which they support, FSDP2's policy, and
clipping."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer

from lightning_canzona.distributed.clipping import agreement_of, clip_grad_norm_

#: The precisions of the Trainer's and Fabric's strategies.
SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


def check_precision(plugin: Any, strategy: str) -> None:
    """Refuse the precision of ``plugin`` (the Trainer's or Fabric's) unless ``strategy`` supports it.

    Raises:
        ValueError: Naming the precision and the supported ones.
    """
    precision = getattr(plugin, "precision", "32-true")
    if precision in SUPPORTED_PRECISION:
        return
    if precision == "64-true":
        why = (
            "Lightning's model-parallel strategies, which it extends, have no float64 precision; for "
            "float64 weights, build the model in float64 (model.double()) and use '32-true'"
        )
    elif precision.startswith("16"):
        why = "fp16 needs loss scaling, which FSDP2's sharded gradients and owner-computed updates lack"
    else:
        why = "it is none of the precisions FSDP2 and the optimizers' updates are built for"
    raise ValueError(
        f"precision={precision!r} is not supported by {strategy}: {why}. Use one of {SUPPORTED_PRECISION}."
    )


def mixed_precision_policy(plugin: Precision) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for the strategy's composition under ``plugin``'s precision.

    ``bf16-mixed``: parameters are all-gathered and used in bf16 while their shards, the
    gradients' reduce-scatter and the optimizer stay float32 (``param_dtype=bfloat16``,
    ``reduce_dtype=float32``): half the all-gather traffic of float32, full-precision gradient
    sums and updates. Lightning's autocast still runs the ops it keeps in float32 in float32.
    ``32-true`` and ``bf16-true`` (parameters already in their compute dtype) need no policy.
    """
    if getattr(plugin, "precision", None) == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def clip_across_meshes(plugin: Precision) -> None:
    """Make ``plugin`` clip gradients by norm over parameters that live on different meshes.

    Lightning clips through the precision plugin, whose ``torch.nn.utils.clip_grad_norm_`` cannot
    combine DTensors of different meshes; every precision the strategy supports clips the same way.
    """

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
        clip_grad_norm_(plugin.main_params(optimizer), clip_val, agreement=agreement_of(optimizer))

    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
