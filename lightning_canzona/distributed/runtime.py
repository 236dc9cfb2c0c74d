"""One optimizer step of one mesh's matrices: prepare, gather, assemble, compute, scatter, apply.

`StepRun.matrices` runs the plan's micro-groups through these phases, pipelined (`run_pipeline`):
`MicroGroupStep` holds one group's phases, `MicroGroupExchange` its two packed all-to-alls, and
every buffer they use is a view of the step's arena (`StepLayout`). An exception in this rank's
own work is kept in `StepRun.failure` while the rank joins the step's remaining collectives with
what its buffers hold. docs/architecture.md#one-step-on-a-mesh tells the step.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_canzona.distributed.agreement import InFlight
from lightning_canzona.distributed.layout import (
    Block,
    LocalShard,
    MatrixLayout,
    Piece,
    local_tensor,
    stack_member,
)
from lightning_canzona.distributed.team_collectives import TeamGroup, TeamRun, run_teams
from lightning_canzona.geometry import member_blocks
from lightning_canzona.planning import Plan
from lightning_canzona.planning.memory import GroupBuffers, arena_layout, pipeline_phases
from lightning_canzona.rules.adamw import MOMENTS as ADAMW_MOMENTS
from lightning_canzona.rules.adamw import adamw_step, init_adamw_state
from lightning_canzona.rules.base import (
    FAILURES,
    STATE_DTYPES,
    MatrixRule,
    State,
    StochasticRounding,
    as_matrix,
    counting_retries,
    matrix_shape,
    state_part,
    store_state_part,
)


@dataclass(frozen=True)
class Entry:
    """A DTensor parameter with its param group, its name, and the rule that updates it
    (``None``: AdamW, elementwise on its shard)."""

    param: DTensor
    group: dict[str, Any]
    name: str
    rule: MatrixRule | None = None


@dataclass(frozen=True)
class Item:
    """One matrix the plan assigns an owner: a parameter, or one matrix of a ``[n, rows, cols]`` stack.

    Attributes:
        entry: Index of the parameter among the engine's matrix entries.
        member: Index in the stack, or ``None`` for the whole parameter.
        layout: Every rank's block of this matrix.
        local_index: Where this rank's local shard holds ``member`` (``None``: nowhere, or no stack).
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


@dataclass
class PlannedMatrices:
    """The matrices of one mesh as planned (plan index = item index), seen from this rank.

    Attributes:
        entries: Replaced, not re-planned, when only the param groups are new dicts (``load_state_dict``).
        group: The plan's ranks: the mesh's, or this rank's HSDP replica's under a replicated plan
            (``rank`` is this rank in it).
        replica: This rank's replica under a replicated plan (0 otherwise); the first's state is of record.
    """

    plan: Plan
    entries: list[Entry]
    items: list[Item]
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
        """Whether this rank computes item ``index`` alone, and so holds its state whole (all: ``sync``)."""
        team = self.team(index)
        return team is None or team == (self.rank,)

    def entry_of(self, index: int) -> Entry:
        return self.entries[self.items[index].entry]

    def key(self, index: int) -> tuple[int, int | None]:
        """What identifies item ``index`` across plans: its parameter and its place in a stack."""
        return id(self.entry_of(index).param), self.items[index].member


class Clock:
    """Marks moments of the work issued on ``device``: host time on a CPU, events elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.on_host = device.type == "cpu"
        self.device = device

    def mark(self) -> float | torch.Event:
        """The current moment of the device's work."""
        if self.on_host:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event


@dataclass
class Intervals:
    """A running total of timed intervals; events are read (and waited for) only in `seconds`."""

    _host: float = 0.0
    _events: list[tuple[torch.Event, torch.Event]] = field(default_factory=list)

    def add(self, start: float | torch.Event, end: float | torch.Event) -> None:
        if isinstance(start, float) and isinstance(end, float):
            self._host += end - start
        else:
            self._events.append((start, end))  # type: ignore[arg-type]

    def extend(self, other: Intervals) -> None:
        self._host += other._host
        self._events.extend(other._events)

    @property
    def seconds(self) -> float:
        """Total seconds of the intervals added so far."""
        total = self._host
        for start, end in self._events:
            end.synchronize()
            total += start.elapsed_time(end) / 1000.0
        return total


class BufferMeter:
    """Live bytes of the tensors given to `track`, and their ``peak`` and ``total`` since `restart`."""

    def __init__(self) -> None:
        self.live = self.peak = self.total = 0
        self._lock = threading.RLock()

    def restart(self) -> None:
        """Start a new measurement (tensors still alive keep counting)."""
        with self._lock:
            self.peak, self.total = self.live, 0

    def track(self, tensor: Tensor) -> Tensor:
        """Count ``tensor`` until it is freed; returns it."""
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            self.live += size
            self.total += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, size)
        return tensor

    def _release(self, size: int) -> None:
        with self._lock:
            self.live -= size


def local_grad(param: Tensor) -> Tensor:
    """This rank's part of ``param``'s gradient; zeros when it has none."""
    return local_tensor(param.grad) if param.grad is not None else torch.zeros_like(local_tensor(param))


def _local_state(state: State) -> State:
    return {key: local_tensor(value) for key, value in state.items()}


def _stored(state: State, keys: Sequence[str], state_dtype: str | None) -> State:
    """New state ``state`` with its elementwise ``keys`` in the group's ``state_dtype``."""
    if state_dtype is None:
        return state
    dtype = STATE_DTYPES[state_dtype]
    return {
        key: value.to(dtype) if key in keys and value.is_floating_point() else value
        for key, value in state.items()
    }


@contextmanager
def _in_param_dtype(
    states: list[State], params: Sequence[Tensor], keys: Sequence[str]
) -> Iterator[list[State]]:
    """What a rule computes with: ``states`` (local), their elementwise ``keys`` kept in another dtype
    than their parameter's (``state_dtype``) as copies in the parameter's, rounded back once at the end."""
    dtypes = [local_tensor(param).dtype for param in params]
    differ = [
        [k for k in keys if k in state and state[k].dtype != dtype] for state, dtype in zip(states, dtypes)
    ]
    if not any(differ):  # the default: the state is in its parameters' dtypes
        yield states
        return
    working = [
        {**state, **{key: state[key].to(dtype) for key in elsewhere}}
        for state, dtype, elsewhere in zip(states, dtypes, differ)
    ]
    yield working
    for state, work, elsewhere in zip(states, working, differ):
        for key in elsewhere:
            state[key].copy_(work[key])


def shard_key(param: Tensor, name: str) -> str:
    """A name for this rank's part of ``param``: the same on its replicas, different on other shards."""
    if not isinstance(param, DTensor):
        return name
    coordinate = param.device_mesh.get_coordinate() or []
    shards = [str(c) for c, placement in zip(coordinate, param.placements) if not placement.is_replicate()]
    return f"{name}@{','.join(shards)}"


@contextmanager
def _written(group: dict[str, Any], targets: list[Tensor], keys: list[str]) -> Iterator[list[Tensor]]:
    """What a step writes: ``targets``, or under ``stochastic_rounding`` float32 copies rounded into them."""
    if not group.get("stochastic_rounding"):
        yield targets
        return
    with StochasticRounding(group["rounding_step"]).writes(targets, keys) as work:
        yield work


def step_adamw(
    params: Sequence[Tensor], names: Sequence[str], state: dict[Tensor, State], group: dict[str, Any]
) -> None:
    """One AdamW step of this rank's parts of ``params`` (named ``names``), all of ``group``."""
    param_states, states = [], []
    for param in params:
        param_state = state.setdefault(param, {})
        if not param_state:
            param_state.update(_stored(init_adamw_state(param), ADAMW_MOMENTS, group.get("state_dtype")))
        param_states.append(param_state)
        states.append(_local_state(param_state))
    targets = [local_tensor(param) for param in params]
    keys = [shard_key(p, n) for p, n in zip(params, names)]
    with _written(group, targets, keys) as written, _in_param_dtype(states, params, ADAMW_MOMENTS) as working:
        adamw_step(
            written,
            [local_grad(param) for param in params],
            working,
            lr=float(group["lr"]),
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )
    for param_state, counted in zip(param_states, working):
        param_state["step"] = counted["step"]  # a number: the local view holds its own


def prepare_matrices(
    params: Sequence[Tensor],
    rule: MatrixRule,
    state: dict[Tensor, State],
    holds_matrix: Sequence[bool],
    state_dtype: str | None = None,
    members: Sequence[int | None] | None = None,
) -> list[Tensor]:
    """``rule``'s elementwise part on this rank's parts of ``params`` (one param group, one call),
    creating the state they need; ``holds_matrix`` says, per parameter, whether this rank computes its full
    update and so holds its matrix state (a stack's matrices create theirs in `member_direction`).
    ``members[i]``: only that matrix of stack ``params[i]``'s local shard (``None``: all of it)."""
    members = members or [None] * len(params)
    states, grads = [], []
    for param, holds, member in zip(params, holds_matrix, members):
        param_state = state.setdefault(param, {})
        # (A stack's state may hold its matrices' already: each owner makes its own when it computes.)
        if not param_state or any(key not in param_state for key in rule.elementwise_state_keys):
            param_state.update(
                _stored(rule.init_elementwise_state(param), rule.elementwise_state_keys, state_dtype)
            )
        if holds and param.ndim != 3 and not rule.matrix_state(param_state):
            param_state.update(rule.init_matrix_state(matrix_shape(param.shape), local_tensor(param).device))
        local = _local_state(param_state)
        if member is not None:
            local = {k: v[member] if k in rule.elementwise_state_keys else v for k, v in local.items()}
        states.append(local)
        grads.append(local_grad(param) if member is None else local_grad(param)[member])
    with _in_param_dtype(states, params, rule.elementwise_state_keys) as working:
        return rule.prepare(grads, working)


def member_prefix(member: int) -> str:
    """The prefix of the state keys of matrix ``member`` of a stack (no ``.``: torch's flattened
    optimizer state dicts split keys on dots)."""
    return f"stack{member}_"


def member_direction(rule: MatrixRule, matrix: Tensor, param_state: State, member: int) -> Tensor:
    """``rule``'s direction for matrix ``member`` of a stack, with that matrix's own state."""
    prefix = member_prefix(member)
    part = state_part(param_state, prefix)
    if all(key == FAILURES for key in part):
        part.update(rule.init_matrix_state(matrix.shape, matrix.device))
    direction = rule.direction(matrix, part)
    store_state_part(param_state, prefix, part)
    return direction


def full_direction(rule: MatrixRule, matrix: Tensor, param_state: State) -> Tensor:
    """``rule``'s direction for a whole parameter: a matrix, or a stack matrix by matrix (each with its
    own state) unless the rule keeps no matrix state."""
    if matrix.ndim != 3 or rule.batches_matrices:
        return rule.direction(as_matrix(matrix), param_state).reshape(matrix.shape)
    return torch.stack([member_direction(rule, m, param_state, e) for e, m in enumerate(matrix)])


def apply_matrices(
    params: Sequence[Tensor],
    names: Sequence[str],
    rule: MatrixRule,
    updates: Sequence[Tensor],
    group: dict[str, Any],
    members: Sequence[int | None] | None = None,
) -> None:
    """Write ``updates`` (this rank's blocks of the directions) into its parts of ``params`` (one
    param group, one call of the rule), or each into matrix ``members[i]`` of a stack."""
    members = members or [None] * len(params)
    targets = [
        local_tensor(param) if member is None else local_tensor(param)[member]
        for param, member in zip(params, members)
    ]
    keys = [
        shard_key(param, name) + ("" if member is None else f"[{member}]")
        for param, name, member in zip(params, names, members)
    ]
    shapes = [matrix_shape(param.shape) for param in params]
    with _written(group, targets, keys) as written:
        rule.apply(written, updates, lr=float(group["lr"]), weight_decay=group["weight_decay"], shapes=shapes)


class MicroGroupExchange:
    """The gather and scatter of one micro-group, seen from one rank.

    Each member matrix goes to the ranks that compute it: its owner (whole), its team (each member a
    slice, `geometry.member_blocks`), or every rank under ``sync`` (``teams is None``). ``members``
    index ``layouts``, ``teams`` and ``batch_keys``; ``rank`` and ``world`` are in the plan's group.
    Every buffer is a view the step hands in (`GroupBuffers`, placed in its arena).
    """

    def __init__(
        self,
        members: Sequence[int],
        layouts: Sequence[MatrixLayout],
        teams: Sequence[tuple[int, ...]] | None,
        rank: int,
        world: int,
        batch_keys: Sequence[Hashable] | None = None,
    ) -> None:
        self.members = tuple(members)
        self.rank, self.world = rank, world
        self.my_shards = {m: layouts[m].shards[rank] for m in members}
        #: Per member matrix, ``(rank, block)`` of every rank that computes it and what it computes.
        targets = {m: _targets(layouts[m].shape, None if teams is None else teams[m], world) for m in members}
        #: The block of each matrix that this rank computes.
        self.regions = {m: block for m in members for r, block in targets[m] if r == rank}
        self.computed = tuple(self.regions)
        #: The computed members in batches, each one call of their rule on a ``[count, rows, cols]``
        #: stack (same ``batch_keys`` entry and shape; alone without keys): ``(members, matrix shape)``.
        batches: dict[Hashable, list[int]] = {}
        for m in self.computed:
            key = m if batch_keys is None else batch_keys[m]
            batches.setdefault((key, self.regions[m].shape), []).append(m)
        self.batches = [
            (tuple(batch), matrix_shape(self.regions[batch[0]].shape)) for batch in batches.values()
        ]
        #: Owners return pieces of their updates; under ``sync`` every rank has them already.
        self.scatters = teams is not None

        def sender(m: int, destination: int, block: Block) -> int:
            """Who sends ``block`` of ``m`` to ``destination``: itself where it holds it, else the first."""
            if teams is not None and layouts[m].holds(destination, block):
                return destination
            return layouts[m].first_holders[block]

        # What goes where, in buffer order: by peer rank, then by member, then by piece. Gathers
        # send local blocks and receive blocks of the computed region; scatters the other way.
        self.gather_send: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        self.gather_recv: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        self.scatter_send: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        self.scatter_recv: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        for m in members:
            shards = layouts[m].shards
            for destination, region in targets[m]:
                for piece in shards[rank].pieces:
                    part = piece.block.intersection(region)
                    if part is not None and sender(m, destination, piece.block) == rank:
                        self.gather_send[destination].append((m, _local_block(piece, part)))
                    if part is not None and teams is not None:
                        self.scatter_recv[destination].append((m, _local_block(piece, part)))
                if destination != rank:
                    continue
                for peer, shard in enumerate(shards):
                    for piece in shard.pieces:
                        part = piece.block.intersection(region)
                        if part is None:
                            continue
                        if sender(m, rank, piece.block) == peer:
                            self.gather_recv[peer].append((m, _relative(part, region)))
                        if teams is not None:
                            self.scatter_send[peer].append((m, _relative(part, region)))

        # What this rank would send itself skips the buffers: copied from its prepared shard into
        # the region it computes (`assemble`), and from its directions into its updates
        # (`my_updates`), once each instead of into a send buffer, through the backend and out of
        # a receive buffer. Both lists hold the same pieces in the same order.
        #: ``(member, block of the local shard, block of the computed region)`` of each such piece.
        self.gather_self = [
            (m, local, region)
            for (m, local), (_, region) in zip(self.gather_send[rank], self.gather_recv[rank])
        ]
        self.scatter_self = [
            (m, local, region)
            for (m, region), (_, local) in zip(self.scatter_send[rank], self.scatter_recv[rank])
        ]
        if teams is None:  # under sync, every piece of this rank's shard is its own
            self.scatter_self = [
                (m, p.local, p.block) for m, shard in self.my_shards.items() for p in shard.pieces
            ]
        for lists in (self.gather_send, self.gather_recv, self.scatter_send, self.scatter_recv):
            lists[rank] = []

        def sizes(lists: list[list[tuple[int, Block]]]) -> list[int]:
            return [sum(block.numel for _, block in pieces) for pieces in lists]

        self.gather_send_sizes, self.gather_recv_sizes = sizes(self.gather_send), sizes(self.gather_recv)
        self.scatter_send_sizes, self.scatter_recv_sizes = sizes(self.scatter_send), sizes(self.scatter_recv)

    def buffers(self, dtype: torch.dtype) -> GroupBuffers:
        """The bytes of this group's arena buffers when it travels in ``dtype``."""
        size = dtype.itemsize
        return GroupBuffers(
            gather_send=sum(self.gather_send_sizes) * size,
            gather_receive=sum(self.gather_recv_sizes) * size,
            own=sum(region.numel for _, _, region in self.gather_self) * size,
            assembled=sum(len(members) * math.prod(shape) for members, shape in self.batches) * size,
            scatter_send=sum(self.scatter_send_sizes) * size,
            scatter_receive=sum(self.scatter_recv_sizes) * size,
            kept=sum(local.numel for _, local, _ in self.scatter_self) * size,
        )

    def pack_gather(self, prepared: dict[int, Tensor], buffers: dict[str, Tensor]) -> None:
        """Copy the ``prepared`` local shards into the gather's ``gather_send`` buffer, and the pieces
        this rank computes itself into its ``own`` buffer (one kernel each)."""
        _pack([prepared[m][local.slices] for m, local, _ in self.gather_self], buffers["own"])
        _pack(
            [prepared[m][local.slices] for ps in self.gather_send for m, local in ps], buffers["gather_send"]
        )

    def launch_gather(self, buffers: dict[str, Tensor], group: dist.ProcessGroup) -> InFlight:
        """Start the gather from the ``gather_send`` into the ``gather_receive`` buffer."""
        send, receive = buffers["gather_send"], buffers["gather_receive"]
        return InFlight(
            dist.all_to_all_single, receive, send, self.gather_recv_sizes, self.gather_send_sizes, group=group
        )

    def stacks(self, out: Tensor) -> list[tuple[tuple[int, ...], Tensor]]:
        """``(members, stack)`` of each batch: a ``[count, rows, cols]`` view of ``out``."""
        stacks, start = [], 0
        for members, shape in self.batches:
            numel = len(members) * math.prod(shape)
            stacks.append((members, out[start : start + numel].view(len(members), *shape)))
            start += numel
        return stacks

    def assemble(self, received: Tensor, own: Tensor, stacks: list[tuple[tuple[int, ...], Tensor]]) -> None:
        """Place the blocks this rank computes, from the gather's ``received`` buffer and its ``own``
        pieces, in their ``stacks``."""
        pieces: dict[int, list[tuple[Block, Tensor]]] = {m: [] for m in self.computed}
        for m, block, chunk in _chunks(received, self.gather_recv):
            pieces[m].append((block, chunk))
        own_chunks = own.split([region.numel for _, _, region in self.gather_self])
        for (m, _, region), chunk in zip(self.gather_self, own_chunks):
            pieces[m].append((region, chunk))
        for members, stack in stacks:
            for matrix, m in zip(stack, members):
                _placed(matrix.view(self.regions[m].shape), pieces[m])

    def pack_scatter(self, directions: dict[int, Tensor], buffers: dict[str, Tensor]) -> None:
        """Copy the pieces of ``directions`` that go to other ranks into the ``scatter_send`` buffer,
        and this rank's own into its ``kept`` buffer, so that the directions' place is free."""
        _pack([directions[m][region.slices] for m, _, region in self.scatter_self], buffers["kept"])
        _pack(
            [directions[m][block.slices] for ps in self.scatter_send for m, block in ps],
            buffers["scatter_send"],
        )

    def launch_scatter(self, buffers: dict[str, Tensor], group: dist.ProcessGroup) -> InFlight:
        """Start returning every rank's pieces: ``scatter_send`` to ``scatter_receive``."""
        send, receive = buffers["scatter_send"], buffers["scatter_receive"]
        return InFlight(
            dist.all_to_all_single,
            receive,
            send,
            self.scatter_recv_sizes,
            self.scatter_send_sizes,
            group=group,
        )

    def my_updates(self, received: Tensor | None, kept: Tensor) -> dict[int, Tensor]:
        """This rank's shard of each member's direction: from the scatter's ``received`` buffer and the
        pieces it ``kept`` of its own directions (`pack_scatter`)."""
        pieces: dict[int, list[tuple[Block, Tensor]]] = {}
        if received is not None:
            for m, local, chunk in _chunks(received, self.scatter_recv):
                pieces.setdefault(m, []).append((local, chunk))
        kept_chunks = kept.split([local.numel for _, local, _ in self.scatter_self])
        for (m, local, _), chunk in zip(self.scatter_self, kept_chunks):
            pieces.setdefault(m, []).append((local, chunk))
        return {m: _local(self.my_shards[m], values) for m, values in pieces.items()}


def _pack(pieces: list[Tensor], out: Tensor) -> None:
    """``pieces`` into ``out``, flat, by one concatenation rather than a copy per piece."""
    flat = [piece.reshape(-1) for piece in pieces]
    assert sum(piece.numel() for piece in flat) == out.numel(), f"{len(flat)} pieces for {out.numel()}"
    if flat:
        torch.cat(flat, out=out)


def _chunks(buffer: Tensor, lists: list[list[tuple[int, Block]]]) -> Iterator[tuple[int, Block, Tensor]]:
    """``(member, block, chunk)``: each entry of ``lists``, in buffer order, with its chunk."""
    entries = [entry for entries in lists for entry in entries]
    chunks = buffer.split([block.numel for _, block in entries])
    return ((m, block, chunk) for (m, block), chunk in zip(entries, chunks))


def _targets(shape: tuple[int, ...], team: tuple[int, ...] | None, world: int) -> list[tuple[int, Block]]:
    """``(rank, block)`` of every rank that computes a matrix: the whole (``sync``), or a member's slice."""
    if team is None:
        return [(rank, Block((0,) * len(shape), shape)) for rank in range(world)]
    return [(rank, Block(*block)) for rank, block in zip(team, member_blocks(shape, len(team)))]


def _local_block(piece: Piece, part: Block) -> Block:
    """Where a rank's local tensor holds ``part`` of its ``piece``."""
    offset = tuple(at + p - g for at, p, g in zip(piece.local.offset, part.offset, piece.block.offset))
    return Block(offset, part.shape)


def _relative(part: Block, region: Block) -> Block:
    """``part`` in the coordinates of the ``region`` that contains it."""
    return Block(tuple(p - r for p, r in zip(part.offset, region.offset)), part.shape)


def _local(shard: LocalShard, pieces: list[tuple[Block, Tensor]]) -> Tensor:
    if len(pieces) == 1 and pieces[0][0].shape == shard.shape:
        return pieces[0][1].view(shard.shape)
    value = pieces[0][1]
    return _placed(torch.empty(shard.shape, dtype=value.dtype, device=value.device), pieces)


def _placed(out: Tensor, pieces: list[tuple[Block, Tensor]]) -> Tensor:
    """``out`` with each ``(block, value)`` copied to its block: by one concatenation in memory order
    where every block is a contiguous run of ``out``, else by a copy each."""
    if all(_contiguous_in(block, out.shape) for block, _ in pieces):
        ordered = sorted(pieces, key=lambda piece: piece[0].offset)
        torch.cat([value.reshape(-1) for _, value in ordered], out=out.view(-1))
        return out
    for block, value in pieces:
        out[block.slices] = value.view(block.shape)
    return out


def _contiguous_in(block: Block, shape: Sequence[int]) -> bool:
    """Whether ``block`` is a contiguous run of a row-major tensor of ``shape``."""
    dims = len(shape)
    first = next((d for d in range(dims) if block.shape[d] != 1), dims - 1)
    return all(block.shape[d] == shape[d] for d in range(first + 1, dims))


@dataclass
class StepStats:
    """What one optimizer step cost this rank, timed on the device (`Clock`).

    Attributes:
        step: The whole step: AdamW, preparation, the micro-group pipeline, the apply.
        compute: The full-matrix updates this rank computes.
        wait: Blocked on gathers and scatters: communication that compute did not hide.
        matrices_computed: Full-matrix updates this rank computed.
        decomposition_failures: Factor decompositions that failed (the previous root or basis was kept).
        decomposition_retries: Factor decompositions that failed in float32 and were redone in float64.
        bytes_sent: Bytes this rank sent to other ranks in all-to-alls.
        all_to_alls: All-to-all collectives issued.
        peak_buffer_bytes: Most bytes of the step's own buffers alive at once (`BufferMeter`).
        team_matrices: Matrices whose update this rank computed a slice of, in a team.
        team_collectives: Collectives among team members that this rank took part in.
    """

    step: Intervals = field(default_factory=Intervals)
    compute: Intervals = field(default_factory=Intervals)
    wait: Intervals = field(default_factory=Intervals)
    matrices_computed: int = 0
    decomposition_failures: int = 0
    decomposition_retries: int = 0
    bytes_sent: int = 0
    all_to_alls: int = 0
    peak_buffer_bytes: int = 0
    team_matrices: int = 0
    team_collectives: int = 0

    def add(self, other: StepStats) -> None:
        """Count ``other`` (another mesh's step) in these."""
        for mine, theirs in ((self.step, other.step), (self.compute, other.compute), (self.wait, other.wait)):
            mine.extend(theirs)
        self.matrices_computed += other.matrices_computed
        self.decomposition_failures += other.decomposition_failures
        self.decomposition_retries += other.decomposition_retries
        self.bytes_sent += other.bytes_sent
        self.all_to_alls += other.all_to_alls
        self.team_matrices += other.team_matrices
        self.team_collectives += other.team_collectives
        # Meshes step one after another: their buffers are never alive together.
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, other.peak_buffer_bytes)


@dataclass
class StepRun:
    """What one step of one mesh's matrices shares: the plan, the rules and state, what the step
    costs (``stats``) and the first exception of this rank's own work (``failure``).

    Nothing between the step's collectives allocates outside `attempt`: the exchanges' buffers are
    views of the arena reserved before the step; the rules' allocations fail into ``failure``, and
    the rank joins the rest of the step's collectives with what its buffers hold."""

    planned: PlannedMatrices
    rules: list[MatrixRule]
    state: dict[Tensor, State]
    team_groups: dict[tuple[int, ...], TeamGroup]
    batch_matrices: bool
    clock: Clock
    meter: BufferMeter
    memory_advice: Callable[[], str] = str
    stats: StepStats = field(default_factory=StepStats)
    failure: Exception | None = None

    def attempt(self, work: Callable[[], Any], fallback: Callable[[], Any] | None = None) -> Any:
        """``work()``, or ``fallback()`` once this step failed on this rank (kept in `failure`; an
        out-of-memory error with ``memory_advice``)."""
        if self.failure is None:
            try:
                return work()
            except torch.OutOfMemoryError as error:
                self.failure = torch.OutOfMemoryError(f"{error} {self.memory_advice()}".strip())
                self.failure.__cause__ = error
            except Exception as error:
                self.failure = error
        return fallback() if fallback is not None else None

    def matrices(self, stepped: Sequence[bool], layout: StepLayout, arena: Tensor) -> None:
        """Prepare, gather, compute, scatter and apply every micro-group of ``layout`` (``stepped``: has a
        gradient), their buffers in ``arena``."""
        stepped_items = [stepped[item.entry] for item in self.planned.items]
        prepare = PreparedEntries(self, stepped)
        steps = [
            MicroGroupStep(self, exchange, dtype, prepare, stepped_items, layout.views(arena, group))
            for group, (exchange, dtype) in enumerate(zip(layout.exchanges, layout.dtypes))
        ]
        with counting_retries() as retries:
            run_pipeline(steps, layout.order)
        self.stats.decomposition_retries += retries()


@dataclass(frozen=True)
class StepLayout:
    """A plan's micro-groups as a step runs them: each group's exchange, the dtype it travels in, and
    where its buffers lie in the step's one arena (`planning.memory.arena_layout`).

    Attributes:
        order: ``(phase, group)`` as the step runs them (`planning.memory.pipeline_phases`).
        offsets: Per group, the byte offset of each of its arena buffers.
        arena_bytes: The arena's size: the most bytes of these buffers alive at once, or little more.
    """

    exchanges: tuple[MicroGroupExchange, ...]
    dtypes: tuple[torch.dtype, ...]
    overlap: bool
    order: tuple[tuple[str, int], ...] = field(init=False)
    buffers: tuple[GroupBuffers, ...] = field(init=False)
    offsets: tuple[dict[str, int], ...] = field(init=False)
    arena_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        buffers = tuple(exchange.buffers(dtype) for exchange, dtype in zip(self.exchanges, self.dtypes))
        offsets, size = arena_layout(buffers, self.overlap)
        object.__setattr__(self, "order", tuple(pipeline_phases(len(self.exchanges), self.overlap)))
        object.__setattr__(self, "buffers", buffers)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "arena_bytes", size)

    def views(self, arena: Tensor, group: int) -> dict[str, Tensor]:
        """Group ``group``'s buffers: views of ``arena`` (bytes) in the dtype the group travels in."""
        buffers, dtype = self.buffers[group], self.dtypes[group]
        return {
            name: arena[offset : offset + getattr(buffers, name)].view(dtype)
            for name, offset in self.offsets[group].items()
        }


class PreparedEntries:
    """The rule's elementwise part of each item on this rank's shard, run when its micro-group first
    needs it (a group's items together, one call per param group): a stack matrix by matrix, so that
    no more than a group's share is ever prepared at once."""

    def __init__(self, run: StepRun, stepped: Sequence[bool]) -> None:
        self.run, self.stepped = run, stepped

    def __call__(self, indices: Sequence[int]) -> dict[int, Tensor]:
        """The pieces of plan items ``indices`` (a micro-group's members)."""
        run, planned = self.run, self.run.planned
        pieces: dict[int, Tensor] = {}
        by_group: dict[int, list[int]] = {}
        for m in indices:
            item = planned.items[m]
            entry = planned.entries[item.entry]
            local = local_tensor(entry.param)
            if item.member is not None and item.local_index is None:
                pieces[m] = local[:0]  # this rank holds none of that matrix
            elif not self.stepped[item.entry]:  # joins the collectives with its weights; nobody applies it
                pieces[m] = local if item.member is None else local[item.local_index]
            else:
                by_group.setdefault(id(entry.group), []).append(m)
        for batch in by_group.values():
            items = [planned.items[m] for m in batch]
            params = [planned.entries[item.entry].param for item in items]
            members = [item.local_index for item in items]
            holds = [planned.holds_whole(m) for m in batch]
            state_dtype = planned.entries[items[0].entry].group.get("state_dtype")
            rule = run.rules[items[0].entry]
            work = functools.partial(prepare_matrices, params, rule, run.state, holds, state_dtype, members)
            # Failed, this rank still sends what it holds: the step raises on every rank, and no
            # allocation here can fail again outside the attempt.
            held = functools.partial(
                list, [local_tensor(p) if i is None else local_tensor(p)[i] for p, i in zip(params, members)]
            )
            for m, param, prepared in zip(batch, params, run.attempt(work, held)):
                # A rule may hand back its input or its state (Shampoo the gradient, Muon its
                # momentum): only a new tensor is memory of the step's own.
                owned = [param.grad, *run.state.get(param, {}).values()]
                if not any(_same_memory(prepared, t) for t in owned if isinstance(t, Tensor)):
                    run.meter.track(prepared)
                pieces[m] = prepared
        return pieces


def _same_memory(tensor: Tensor, other: Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == local_tensor(other).untyped_storage().data_ptr()


def _team_start(rule: MatrixRule, shape: tuple[int, ...], member: int, size: int) -> Callable[..., Any]:
    return lambda matrix, state: rule.team_direction(matrix, shape, member, size, state)


class MicroGroupStep:
    """One micro-group's gather, assembly, compute, scatter and finish (`run_pipeline` calls them),
    its buffers views of the step's arena (``buffers``: `GroupBuffers.ARENA` by name)."""

    def __init__(
        self,
        run: StepRun,
        exchange: MicroGroupExchange,
        dtype: torch.dtype,
        prepare: PreparedEntries,
        stepped: list[bool],
        buffers: dict[str, Tensor],
    ) -> None:
        self.run, self.exchange, self.dtype = run, exchange, dtype
        self.prepare, self.stepped, self.buffers = prepare, stepped, buffers
        self.directions: dict[int, Tensor] = {}
        self.scatter_work: InFlight | None = None

    def gather(self) -> None:
        # Prepared here, not for every group up front: the buffers copy them at once.
        run = self.run
        prepared = self.prepare(self.exchange.members)
        run.attempt(functools.partial(self.exchange.pack_gather, prepared, self.buffers))
        self.gather_work = self.exchange.launch_gather(self.buffers, run.planned.group)
        self._count(self.buffers["gather_send"].element_size(), self.exchange.gather_send_sizes)

    def assemble(self) -> None:
        run, buffers = self.run, self.buffers
        start = run.clock.mark()
        self.gather_work.wait()
        run.stats.wait.add(start, run.clock.mark())
        del self.gather_work
        self.stacks = self.exchange.stacks(buffers["assembled"])
        run.attempt(
            functools.partial(self.exchange.assemble, buffers["gather_receive"], buffers["own"], self.stacks)
        )
        # Each direction takes its matrix's place in the stack. One that nobody computes (no
        # gradient, or this rank failed) is its matrix, which nobody applies.
        for members, stack in self.stacks:
            self.directions.update((m, self._region(m, matrix)) for m, matrix in zip(members, stack))

    def compute(self) -> None:
        stats, clock = self.run.stats, self.run.clock
        computing = clock.mark()
        stacks, planned = self.stacks, self.run.planned
        del self.stacks
        in_teams = [(ms, stack) for ms, stack in stacks if len(planned.team(ms[0]) or ()) > 1]
        # Teams first: their members start together (the gather synchronised them), and none
        # waits in a team's collective for another's own matrices.
        if in_teams:
            self._team_directions(in_teams)
        for members, stack in stacks:
            if len(planned.team(members[0]) or ()) <= 1:
                for calls, inputs in self._calls(members, stack):
                    work = functools.partial(self._direction, calls, inputs)
                    self._place(calls, self.run.attempt(work))
        stats.compute.add(computing, clock.mark())

    def _calls(self, members: tuple[int, ...], stack: Tensor) -> list[tuple[list[int], Tensor]]:
        """The calls of the rule on a batch: all of it at once, or where only some members have a
        gradient, each of those alone (a view: nothing is copied out of the stack)."""
        chosen = [j for j, m in enumerate(members) if self.stepped[m]]
        if len(chosen) == len(members) > 1:
            return [(list(members), stack)]
        return [([members[j]], stack[j]) for j in chosen]

    def _place(self, members: list[int], directions: Tensor | None) -> None:
        """Copy ``directions`` (of ``members``, stacked or one) into their matrices' places."""

        def copy() -> None:
            for m, direction in zip(members, directions if len(members) > 1 else [directions]):
                self.directions[m].copy_(direction.reshape(self.directions[m].shape))

        if directions is not None:
            self.run.attempt(copy)

    def _region(self, m: int, matrix: Tensor) -> Tensor:
        return matrix.reshape(self.exchange.regions[m].shape)

    def _team_directions(self, batches: list[tuple[tuple[int, ...], Tensor]]) -> None:
        """This rank's slices of the updates it computes in teams, all teams in lockstep."""
        run, planned = self.run, self.run.planned
        runs, batched, states = [], [], []
        for members, stack in batches:
            m = members[0]
            team, rule, shape = planned.team(m), self._rule(m), planned.items[m].layout.shape
            assert team is not None
            member = team.index(planned.rank)
            start = _team_start(rule, shape, member, len(team))
            for calls, inputs in self._calls(members, stack):
                state = self._member_state(calls[0], rule, member, len(team), inputs.device)
                runs.append(TeamRun(team, start, inputs, state))
                batched.append(calls)
                states.append(state)
        failures = [state.get(FAILURES, 0) for state in states]
        results, collectives = run_teams(runs, run.team_groups, run.attempt, lambda: run.failure is not None)
        for members, result, state, before in zip(batched, results, states, failures):
            self._place(members, result)
            run.stats.team_matrices += len(members)
            run.stats.decomposition_failures += state.get(FAILURES, 0) - before
            if state:
                self._store_member_state(members[0], state)
        run.stats.team_collectives += collectives

    def _member_state(self, m: int, rule: MatrixRule, member: int, size: int, device: torch.device) -> State:
        """This member's state of team item ``m`` (created on first use; ``{}`` for a stateless batch)."""
        if rule.batches_matrices:
            return {}
        item = self.run.planned.items[m]
        param_state = self.run.state.setdefault(self.run.planned.entries[item.entry].param, {})
        prefix = "" if item.member is None else member_prefix(item.member)
        part = state_part(param_state, prefix) if prefix else rule.matrix_state(param_state)
        if all(key == FAILURES for key in part):
            part.update(rule.init_team_state(item.layout.shape, member, size, device))
        return part

    def _store_member_state(self, m: int, part: State) -> None:
        item = self.run.planned.items[m]
        param_state = self.run.state[self.run.planned.entries[item.entry].param]
        store_state_part(param_state, "" if item.member is None else member_prefix(item.member), part)

    def _rule(self, m: int) -> MatrixRule:
        return self.run.rules[self.run.planned.items[m].entry]

    def _direction(self, members: list[int], inputs: Tensor) -> Tensor:
        """The directions of ``members``: one batched call on their ``[count, rows, cols]`` stack (the
        rule keeps no matrix state), or one matrix's with its state."""
        stats, meter = self.run.stats, self.run.meter
        if len(members) > 1:
            stats.matrices_computed += len(members)
            return meter.track(self._rule(members[0]).direction(inputs, {}))
        (m,) = members
        item = self.run.planned.items[m]
        param_state = self.run.state[self.run.planned.entries[item.entry].param]
        failures = param_state.get(FAILURES, 0)
        if item.member is None:
            direction = self._rule(m).direction(inputs, param_state)
        else:
            direction = member_direction(self._rule(m), inputs, param_state, item.member)
        stats.matrices_computed += 1
        stats.decomposition_failures += param_state.get(FAILURES, 0) - failures
        return meter.track(direction)

    def scatter(self) -> None:
        run = self.run
        run.attempt(functools.partial(self.exchange.pack_scatter, self.directions, self.buffers))
        self.directions = {}
        if self.exchange.scatters:
            self.scatter_work = self.exchange.launch_scatter(self.buffers, run.planned.group)
            self._count(self.buffers["scatter_send"].element_size(), self.exchange.scatter_send_sizes)

    def finish(self) -> None:
        received = None
        if self.scatter_work is not None:
            clock = self.run.clock
            start = clock.mark()
            self.scatter_work.wait()
            self.run.stats.wait.add(start, clock.mark())
            received = self.buffers["scatter_receive"]
        run, planned = self.run, self.run.planned
        work = functools.partial(self.exchange.my_updates, received, self.buffers["kept"])
        by_group: dict[int, list[tuple[Item, Tensor]]] = {}  # one call of the rule per param group
        for m, update in (run.attempt(work) or {}).items():
            if self.stepped[m]:
                item = planned.items[m]
                by_group.setdefault(id(planned.entries[item.entry].group), []).append((item, update))
        for updates in by_group.values():
            entries = [planned.entries[item.entry] for item, _ in updates]
            work = functools.partial(
                apply_matrices,
                [entry.param for entry in entries],
                [entry.name for entry in entries],
                self.run.rules[updates[0][0].entry],
                [update for _, update in updates],
                entries[0].group,
                [item.local_index for item, _ in updates],
            )
            run.attempt(work)
        self.scatter_work = None

    def _count(self, element_bytes: int, send_sizes: list[int]) -> None:
        self.run.stats.all_to_alls += 1
        # What leaves this rank: its block for itself stays in memory.
        others = sum(send_sizes) - send_sizes[self.run.planned.rank]
        self.run.stats.bytes_sent += element_bytes * others


def run_pipeline(steps: Sequence[MicroGroupStep], order: Iterable[tuple[str, int]]) -> None:
    """Run every micro-group's phases in ``order`` (`StepLayout.order`), the same collectives in the
    same order on every rank::

        gather 0, gather 1, [assemble 0, compute 0], scatter 0, gather 2, [assemble 1, compute 1,
        finish 0], scatter 1, …
    """
    for phase, group in order:
        getattr(steps[group], phase)()
