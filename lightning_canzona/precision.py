"""Lightning precision plugins under `CanzonaStrategy`."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from lightning_canzona.distributed.clipping import clip_grad_norm_


def clip_across_meshes(plugin: Precision) -> None:
    """Make ``plugin`` clip gradients by norm over parameters that live on different meshes.

    Lightning clips through the precision plugin, whose ``torch.nn.utils.clip_grad_norm_`` cannot
    combine DTensors of different meshes; every precision the strategy supports clips the same way.
    """

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
        clip_grad_norm_(plugin.main_params(optimizer), clip_val)

    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
