"""``torch.optim.Muon`` → `lightning_canzona.Muon`, group for group."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_canzona.optim.optimizers import Muon
from lightning_canzona.planning import PlanSettings


def is_torch_muon(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is ``torch.optim.Muon`` (which exists from torch 2.9 on)."""
    return type(optimizer).__name__ == "Muon" and type(optimizer).__module__.startswith("torch.optim")


def convert_torch_muon(
    optimizer: Optimizer, module: nn.Module, settings: PlanSettings, overlap: bool
) -> Muon:
    """A `Muon` with ``optimizer``'s param groups, one to one, and their hyperparameters.

    `Muon` takes ``torch.optim.Muon``'s keywords with the same meaning. Groups keep their order
    and every key (a scheduler's ``initial_lr`` among them), so a learning-rate scheduler built on
    ``optimizer`` drives the new one once re-pointed at it, and ``param_groups[i]`` edits keep
    working. Parameters are named after ``module``'s.
    """
    names = {id(param): name for name, param in module.named_parameters()}
    groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(group["params"])],
            "algorithm": "muon",
        }
        for group in optimizer.param_groups
    ]
    return Muon(
        groups,
        policy=settings.policy,
        alpha=settings.alpha,
        cost=settings.cost,
        micro_group_capacity=settings.capacity,
        max_team=settings.max_team,
        overlap=overlap,
    )


def repoint_scheduler(scheduler: LRScheduler, optimizer: Optimizer) -> None:
    """Make ``scheduler`` drive ``optimizer`` (the conversion of the one it was built on).

    The scheduler's groups are the optimizer's groups one to one, so its state carries over. Its
    check that ``optimizer.step()`` runs before ``scheduler.step()`` watches a wrapper that
    ``LRScheduler.__init__`` put on the old optimizer's ``step``; the same marks go on the new one,
    or every run would warn that the order is wrong.
    """
    scheduler.optimizer = optimizer
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]
