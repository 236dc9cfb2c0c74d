"""torchmetrics under tensor parallelism and in-process launches."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn


def prepare_metrics(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Sync every torchmetrics `Metric` of ``module`` over ``group`` and give it private states.

    Tensor-parallel ranks see the same batch, so metrics must sync over the data-parallel group
    (``group``) to count each sample once; a metric given its own ``process_group`` keeps it.
    Each rank also gets private metric states: a spawned rank unpickles CPU tensors into memory
    shared with the other ranks (Lightning unshares parameters and buffers, which metric states
    are not), so every rank would otherwise add into one tensor.
    """
    from torchmetrics import Metric

    for metric in module.modules():
        if not isinstance(metric, Metric):
            continue
        if metric.process_group is None:
            metric.process_group = group
        for name, value in metric.metric_state.items():
            if isinstance(value, Tensor) and value.is_shared():
                setattr(metric, name, value.clone())
            elif isinstance(value, list):
                setattr(metric, name, [v.clone() if v.is_shared() else v for v in value])
