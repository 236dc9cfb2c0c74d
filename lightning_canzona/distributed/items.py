"""What the engine plans: its entries (DTensor parameters), their items (matrices) and who
computes each — the surface that the step's runtime and the custody of matrix state read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_canzona.distributed.layout import MatrixLayout, stack_member
from lightning_canzona.planning import Plan
from lightning_canzona.rules.base import MatrixRule


@dataclass(frozen=True)
class Entry:
    """A DTensor parameter with its param group, its name, and the algorithm that updates it."""

    param: DTensor
    group: dict[str, Any]
    name: str

    @property
    def algorithm(self) -> str:
        return self.group["algorithm"]


@dataclass(frozen=True)
class Item:
    """One matrix the plan assigns an owner: a parameter, or one matrix of a stack.

    Each matrix of a ``[n, rows, cols]`` stack (mixture-of-experts experts) is planned, owned and
    moved alone, so that an expert that FSDP2 leaves whole on one rank is updated where it lies.
    Its matrix state (Shampoo's and SOAP's factors) lives with its owner, in its parameter's state
    under the keys of `updates.member_prefix`; a rule without matrix state (`MatrixRule.batches_matrices`:
    Muon) updates an owner's same-shape matrices in one batched call.

    Attributes:
        entry: Index of the parameter among the engine's matrix entries.
        member: Index in the stack (dim 0), or ``None`` for the whole parameter.
        layout: Every rank's block of this matrix.
        local_index: This rank's index of ``member`` in its local shard (``None``: it holds none
            of it, or the item is the whole parameter).
    """

    entry: int
    member: int | None
    layout: MatrixLayout
    local_index: int | None = None


def build_items(entries: Sequence[Entry], layouts: Sequence[MatrixLayout], rank: int) -> list[Item]:
    """The items of ``entries`` (whose layouts are ``layouts``), in order: a stack's one by one."""
    items = []
    for index, (entry, layout) in enumerate(zip(entries, layouts)):
        if entry.param.ndim != 3:
            items.append(Item(index, None, layout))
            continue
        for member in range(layout.shape[0]):
            member_layout, positions = stack_member(layout, member)
            items.append(Item(index, member, member_layout, positions[rank]))
    return items


def entry_rules(
    entries: Sequence[Entry], rule_of: Callable[[dict[str, Any]], MatrixRule]
) -> list[MatrixRule]:
    """Each entry's rule, built once per param group (entries share their group's)."""
    by_group: dict[int, MatrixRule] = {}
    for entry in entries:
        if id(entry.group) not in by_group:
            by_group[id(entry.group)] = rule_of(entry.group)
    return [by_group[id(entry.group)] for entry in entries]


@dataclass
class PlannedMatrices:
    """The matrices of one mesh as planned, seen from this rank.

    Attributes:
        plan: The plan (plan index = item index).
        entries: The matrix entries; replaced, not re-planned, when only the param groups are
            new dicts (``load_state_dict``), so that hyperparameters are read from the current ones.
        items: The matrices the plan covers.
        first_item: Each entry's first item.
        group: The process group of the plan's ranks: the mesh's, or this rank's HSDP
            replica's under a replicated plan (`planning.replication`).
        rank: This rank in ``group``.
        replica: This rank's replica under a replicated plan (0 otherwise): each replica's
            owners hold the same matrix state, the first replica's is the one of record.
    """

    plan: Plan
    entries: list[Entry]
    items: list[Item]
    first_item: list[int]
    group: dist.ProcessGroup
    rank: int
    replica: int = 0

    def owner(self, index: int) -> int | None:
        """Owner group-rank of item ``index`` (``None`` under ``sync``)."""
        return None if self.plan.owners is None else self.plan.owners[index]

    def team(self, index: int) -> tuple[int, ...] | None:
        """The ranks that compute item ``index`` (``None`` under ``sync``)."""
        return None if self.plan.teams is None else self.plan.teams[index]

    def holds_whole(self, index: int) -> bool:
        """Whether this rank computes item ``index`` alone, and so holds its matrix state whole
        (everyone under ``sync``)."""
        team = self.team(index)
        return team is None or team == (self.rank,)

    def entry_of(self, index: int) -> Entry:
        """The entry of item ``index``."""
        return self.entries[self.items[index].entry]

    def key(self, index: int) -> tuple[int, int | None]:
        """What identifies item ``index`` across plans: its parameter and its place in a stack."""
        return id(self.entry_of(index).param), self.items[index].member
