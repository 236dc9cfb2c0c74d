"""Which optimizer a checkpoint's optimizer state belongs to.

A checkpoint records, for each optimizer, its class, each param group's algorithm and the state
keys of each algorithm (`record`). Loading compares the record with the run's optimizers before
any state is touched (`check_same_optimizers`): Muon's momenta loaded into a SOAP run would
otherwise come back as SOAP's param groups with Muon's learning rates and a state mixing both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_canzona.optim import MatrixOptimizer
from lightning_canzona.rules.adamw import ALGORITHM as ADAMW
from lightning_canzona.rules.adamw import init_adamw_state


def record(optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """The record of ``optimizers`` that a checkpoint keeps (plain data: strings and lists)."""
    return {"optimizers": [_describe(optimizer) for optimizer in optimizers]}


def check_same_optimizers(saved: dict[str, Any] | None, optimizers: Sequence[Optimizer], path: Any) -> None:
    """Raise a `ValueError` naming both when the checkpoint at ``path`` holds the state of other
    optimizers than ``optimizers`` (another class, or other algorithms in its param groups).

    A checkpoint saved without a record (by an earlier version, or another strategy) is not checked.
    """
    if saved is None:
        return
    current = record(optimizers)["optimizers"]
    before = saved.get("optimizers", [])
    same = len(before) == len(current) and all(
        (a["class"], a["algorithms"]) == (b["class"], b["algorithms"]) for a, b in zip(before, current)
    )
    if not same:
        raise ValueError(
            f"The checkpoint {path} holds the state of {_summary(before)}, but this run's optimizer is "
            f"{_summary(current)}: its state cannot be loaded into another optimizer. Resume with the "
            "same optimizer, or load the weights only and start the optimizer afresh with "
            "CanzonaStrategy(load_optimizer_state=False)."
        )


def _describe(optimizer: Optimizer) -> dict[str, Any]:
    cls = type(optimizer)
    module = "lightning_canzona" if cls.__module__.startswith("lightning_canzona.") else cls.__module__
    algorithms = [group.get("algorithm") for group in optimizer.param_groups]
    described: dict[str, Any] = {"class": f"{module}.{cls.__qualname__}", "algorithms": algorithms}
    if isinstance(optimizer, MatrixOptimizer):
        described["state_keys"] = {
            algorithm: _state_keys(optimizer, group)
            for algorithm, group in {g["algorithm"]: g for g in optimizer.param_groups}.items()
        }
    return described


def _state_keys(optimizer: MatrixOptimizer, group: dict[str, Any]) -> list[str]:
    """The keys of the state that a group's algorithm keeps for a parameter (of a small matrix)."""
    if group["algorithm"] == ADAMW:
        return sorted(init_adamw_state(torch.zeros(1)))
    rule = optimizer.matrix_rule(group)
    matrix = sorted(rule.init_matrix_state(torch.Size((4, 4)), torch.device("cpu")))
    return sorted(rule.elementwise_state_keys) + matrix


def _summary(optimizers: Sequence[dict[str, Any]]) -> str:
    def one(described: dict[str, Any]) -> str:
        keys = described.get("state_keys", {})
        groups = ", ".join(
            f"{a} ({', '.join(keys[a])})" if a in keys else str(a)
            for a in dict.fromkeys(described["algorithms"])
        )
        return f"{described['class']} [param groups: {groups}]"

    return " and ".join(one(d) for d in optimizers) or "no optimizer"
