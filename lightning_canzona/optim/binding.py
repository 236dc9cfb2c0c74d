"""How a strategy takes the user's optimizer: `bind_optimizer`."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_canzona.compat import track_optimizer_steps
from lightning_canzona.config import PlanConfig
from lightning_canzona.optim.optimizer import MatrixOptimizer
from lightning_canzona.optim.optimizers import Muon


def bind_optimizer(
    optimizer: Optimizer,
    module: nn.Module,
    config: PlanConfig | None,
    schedulers: Sequence[LRScheduler] = (),
    source: str = "CanzonaStrategy",
) -> tuple[Optimizer, str | None]:
    """``optimizer`` as the strategy ``source`` runs it, and a line to tell the user, if any."""
    if isinstance(optimizer, MatrixOptimizer):
        if config is not None:
            optimizer.adopt_plan_config(config, source)
        return optimizer, None
    if not is_torch_muon(optimizer):
        return optimizer, None
    converted = convert_torch_muon(optimizer, module, config)
    for scheduler in schedulers:
        if scheduler.optimizer is optimizer:
            repoint_scheduler(scheduler, converted)
    return converted, (
        "lightning_canzona: converted torch.optim.Muon to lightning_canzona.Muon with the same "
        "settings, so that each matrix update is computed once, on one owner."
    )


def is_torch_muon(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is ``torch.optim.Muon`` (which exists from torch 2.9 on)."""
    return type(optimizer).__name__ == "Muon" and type(optimizer).__module__.startswith("torch.optim")


def convert_torch_muon(optimizer: Optimizer, module: nn.Module, config: PlanConfig | None = None) -> Muon:
    """A `Muon` with ``optimizer``'s param groups, one to one, every key kept, in bfloat16 as torch's."""
    names = {id(param): name for name, param in module.named_parameters()}
    groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(group["params"])],
            "algorithm": "muon",
        }
        for group in optimizer.param_groups
    ]
    return Muon(groups, plan=config, compute_dtype="bfloat16")  # torch.optim.Muon's, on every device


def repoint_scheduler(scheduler: LRScheduler, optimizer: Optimizer) -> None:
    """Make ``scheduler`` drive ``optimizer``, with the step-order marks ``LRScheduler`` puts on it."""
    scheduler.optimizer = optimizer
    track_optimizer_steps(optimizer)
