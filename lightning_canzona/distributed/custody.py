"""Custody of matrix state: where each matrix's state lives, and moving it there.

`MatrixStateCustody` moves a matrix's state (whole with its owner, or in slices with its team:
docs/architecture.md#teams) when a new plan gives it to other ranks, puts a team's state whole on
its first member for checkpoints and back, and trims a full checkpoint loaded on every rank.
Every method that moves state is collective over the mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_canzona.distributed.runtime import PlannedMatrices, member_prefix
from lightning_canzona.distributed.team_collectives import joined_state, member_state
from lightning_canzona.geometry import long_dim
from lightning_canzona.rules import counters
from lightning_canzona.rules.base import MatrixRule, State
from lightning_canzona.rules.kronecker import FAILURES

#: Who computed each item under a previous plan, by `PlannedMatrices.key`.
Teams = dict[tuple[int, int | None], tuple[int, ...] | None]


class MatrixStateCustody:
    """The matrix state of one mesh's ``planned`` matrices (with ``rules``) in the optimizer's ``state``."""

    def __init__(
        self, planned: PlannedMatrices, rules: Sequence[MatrixRule], state: dict[Tensor, State]
    ) -> None:
        self.planned, self.rules, self.state = planned, rules, state

    def teams(self) -> Teams:
        """Who computes each item now: what `move` compares a later plan with."""
        planned = self.planned
        return {planned.key(index): planned.team(index) for index in range(len(planned.items))}

    def move(self, previous: Teams | None) -> None:
        """Hand matrix state over where this plan gives a matrix to other ranks than ``previous``."""
        planned = self.planned
        for index in range(len(planned.items)):
            old = (previous or {}).get(planned.key(index), planned.team(index))
            if old != planned.team(index):
                self.hand_over(index, old, planned.team(index))
        self.drop_foreign()
        if not previous:
            self.keep_loaded_stack_failures_on_one_owner()

    def hand_over(self, index: int, old: tuple[int, ...] | None, new: tuple[int, ...] | None) -> None:
        """Move item ``index``'s matrix state from ranks ``old`` to ranks ``new`` (a team's in slices;
        ``None``: every rank whole, as under ``sync``); every source broadcasts what it holds."""
        planned = self.planned
        item, param = planned.items[index], planned.entry_of(index).param
        held = self.state.get(param, {})
        # Counters travel as the tensors a state dict holds, and are numbers again on arrival.
        mine = counters.saved({key: held.pop(key) for key in self.state_keys(index)})
        parts = []
        for source in (0,) if old is None else old:
            source_rank = dist.get_global_rank(planned.group, source)
            sent = mine if source == planned.rank else None
            parts.append(broadcast_state(sent, source_rank, planned.group, param.device))
        if new is not None and planned.rank not in new or not parts[0]:
            return
        sliced = self.sliced_keys(index)
        whole = parts[0] if len(parts) == 1 else joined_state(parts, sliced, item.layout.shape)
        if new is not None and len(new) > 1:
            whole = member_state(whole, sliced, item.layout.shape, new.index(planned.rank), len(new))
        moved = {
            key: value.to(param.device) if isinstance(value, Tensor) else value
            for key, value in counters.running(whole).items()
        }
        self.state.setdefault(param, {}).update(moved)

    def state_keys(self, index: int) -> list[str]:
        """The keys of item ``index``'s matrix state: all its parameter's, or one stack matrix's."""
        item = self.planned.items[index]
        held = self.state.get(self.planned.entry_of(index).param, {})
        keys = list(self.rules[item.entry].matrix_state(held))
        if item.member is None:
            return keys
        return [key for key in keys if key.startswith(member_prefix(item.member))]

    def sliced_keys(self, index: int) -> set[str]:
        """The keys of item ``index``'s state that a team member holds a slice of."""
        item = self.planned.items[index]
        prefix = "" if item.member is None else member_prefix(item.member)
        return {prefix + key for key in self.rules[item.entry].team_sliced_keys(item.layout.shape)}

    def stateful_team_items(self) -> list[int]:
        """The items that a team computes and whose members hold slices of matrix state."""
        planned = self.planned
        return [
            index
            for index, item in enumerate(planned.items)
            if len(planned.team(index) or ()) > 1
            and self.rules[item.entry].team_sliced_keys(item.layout.shape)
        ]

    def drop_foreign(self) -> None:
        """Keep only the matrix state this rank holds (a full checkpoint loads all of it everywhere)."""
        planned = self.planned
        for index, item in enumerate(planned.items):
            if planned.owner(index) is None:
                continue
            held = self.state.get(planned.entry_of(index).param, {})
            keys = self.state_keys(index)
            team = planned.team(index) or ()
            if planned.rank not in team:
                for key in keys:
                    del held[key]
            elif len(team) > 1 and self.is_whole(index, held):
                member = member_state(
                    {key: held[key] for key in keys},
                    self.sliced_keys(index),
                    item.layout.shape,
                    team.index(planned.rank),
                    len(team),
                )
                held.update(member)

    def keep_loaded_stack_failures_on_one_owner(self) -> None:
        """After a load, leave a stack's failure count (its owners' total) with its first matrix's owner
        only: the others count from zero, and the next checkpoint adds them up (`owned`)."""
        planned = self.planned
        first_owner: dict[int, int | None] = {}
        for index, item in enumerate(planned.items):
            if item.member is not None:
                first_owner.setdefault(item.entry, planned.owner(index))
        for entry, owner in first_owner.items():
            if owner is not None and owner != planned.rank:
                self.state.get(planned.entries[entry].param, {}).pop(FAILURES, None)

    def is_whole(self, index: int, held: State) -> bool:
        """Whether ``held`` has item ``index``'s sliced state at the matrix's whole shape."""
        shape = tuple(self.planned.items[index].layout.shape)
        dim = long_dim(shape)
        sliced = [held[key] for key in self.sliced_keys(index) if key in held]
        return bool(sliced) and all(value.shape[dim] == shape[dim] for value in sliced)

    def gather_team_state(self) -> None:
        """Put every team's matrix state whole on its first member, as a checkpoint holds it."""
        for index in self.stateful_team_items():
            team = self.planned.team(index)
            assert team is not None
            self.hand_over(index, team, team[:1])

    def scatter_team_state(self) -> None:
        """Give every team's members their slices of the state its first member holds whole."""
        planned = self.planned
        for index in self.stateful_team_items():
            team = planned.team(index)
            assert team is not None
            held = self.state.get(planned.entry_of(index).param, {})
            whole = [planned.rank == team[0] and self.is_whole(index, held)]
            source = dist.get_global_rank(planned.group, team[0])
            dist.broadcast_object_list(whole, src=source, group=planned.group)
            if whole[0]:
                self.hand_over(index, team[:1], team)

    def owned(self) -> dict[int, State]:
        """This rank's matrix state of the matrices it owns (a team's first member: its part, or all of
        it after `gather_team_state`), by entry index; on the first replica only under a replicated plan.
        A stack's failure count is each owner's own: a checkpoint holds their sum."""
        planned = self.planned
        if planned.plan.owners is None or planned.replica:  # another replica's are of record
            return {}
        owned: dict[int, State] = {}
        for index, item in enumerate(planned.items):
            if planned.owner(index) == planned.rank:
                held = self.state.get(planned.entry_of(index).param, {})
                part = {key: held[key] for key in self.state_keys(index)}
                if item.member is not None and FAILURES in held:
                    part[FAILURES] = held[FAILURES]
                owned.setdefault(item.entry, {}).update(part)
        return {entry: part for entry, part in owned.items() if part}


class _Spec(NamedTuple):
    """A tensor of `broadcast_state`, as its receivers are told of it."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def broadcast_state(
    state: State | None, source: int, group: dist.ProcessGroup, device: torch.device
) -> State:
    """``state``, passed by global rank ``source`` (``None`` elsewhere), on every rank of ``group``."""
    # Keys, dtypes and shapes travel as an object, the bytes as one uint8 tensor on ``device``: a
    # tensor inside an object collective is pickled through the host and arrives on the sender's
    # device index, and an NCCL group takes no host tensor.
    layout: list[dict | None] = [None]
    if state is not None:
        layout[0] = {
            key: _Spec(value.dtype, tuple(value.shape)) if isinstance(value, Tensor) else value
            for key, value in state.items()
        }
    dist.broadcast_object_list(layout, src=source, group=group)
    received = dict(layout[0] or {})
    specs = {key: spec for key, spec in received.items() if isinstance(spec, _Spec)}
    sizes = [math.prod(spec.shape) * spec.dtype.itemsize for spec in specs.values()]
    if state is not None:
        if specs:
            pieces = [state[key].detach().reshape(-1).view(torch.uint8).to(device) for key in specs]
            dist.broadcast(torch.cat(pieces), src=source, group=group)
        return dict(state)
    if specs:
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(buffer, src=source, group=group)
        for (key, spec), piece in zip(specs.items(), buffer.split(sizes)):
            # A copy of its own: aligned for its dtype, and no view of the shared buffer.
            received[key] = piece.clone().view(spec.dtype).reshape(spec.shape)
    return received
