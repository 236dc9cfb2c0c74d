"""One optimizer step of one mesh's matrices: prepare, gather, compute, scatter, apply.

`StepRun.matrices` runs the plan's micro-groups through these phases, pipelined (`run_pipeline`):
`MicroGroupStep` holds one group's phases, `MicroGroupExchange` its two packed all-to-alls. An
exception in this rank's own work is kept in `StepRun.failure` while the rank joins the step's
remaining collectives with zeros. docs/architecture.md#one-step-on-a-mesh tells the step.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
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
) -> list[Tensor]:
    """``rule``'s elementwise part on this rank's parts of ``params`` (one param group, one call),
    creating the state they need; ``holds_matrix`` says, per parameter, whether this rank computes its full
    update and so holds its matrix state (a stack's matrices create theirs in `member_direction`)."""
    states = []
    for param, holds in zip(params, holds_matrix):
        param_state = state.setdefault(param, {})
        if not param_state:
            param_state.update(
                _stored(rule.init_elementwise_state(param), rule.elementwise_state_keys, state_dtype)
            )
        if holds and param.ndim != 3 and not rule.matrix_state(param_state):
            param_state.update(rule.init_matrix_state(matrix_shape(param.shape), local_tensor(param).device))
        states.append(_local_state(param_state))
    with _in_param_dtype(states, params, rule.elementwise_state_keys) as working:
        return rule.prepare([local_grad(param) for param in params], working)


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
    index ``layouts`` and ``teams``; ``rank`` and ``world`` are in the plan's group.
    """

    def __init__(
        self,
        members: Sequence[int],
        layouts: Sequence[MatrixLayout],
        teams: Sequence[tuple[int, ...]] | None,
        rank: int,
        world: int,
    ) -> None:
        self.members = tuple(members)
        self.rank, self.world = rank, world
        self.my_shards = {m: layouts[m].shards[rank] for m in members}
        #: Per member matrix, ``(rank, block)`` of every rank that computes it and what it computes.
        targets = {m: _targets(layouts[m].shape, None if teams is None else teams[m], world) for m in members}
        #: The block of each matrix that this rank computes.
        self.regions = {m: block for m in members for r, block in targets[m] if r == rank}
        self.computed = tuple(self.regions)
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
        for lists in (self.gather_send, self.gather_recv, self.scatter_send, self.scatter_recv):
            lists[rank] = []

        def sizes(lists: list[list[tuple[int, Block]]]) -> list[int]:
            return [sum(block.numel for _, block in pieces) for pieces in lists]

        self.gather_send_sizes, self.gather_recv_sizes = sizes(self.gather_send), sizes(self.gather_recv)
        self.scatter_send_sizes, self.scatter_recv_sizes = sizes(self.scatter_send), sizes(self.scatter_recv)

    def launch_gather(
        self,
        prepared: dict[int, Tensor],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        meter: BufferMeter,
    ) -> tuple[Tensor, InFlight]:
        """Start the gather of the ``prepared`` local shards; returns the receive buffer and handle."""
        pieces = (prepared[m][local.slices] for ps in self.gather_send for m, local in ps)
        return _exchanged(pieces, self.gather_send_sizes, self.gather_recv_sizes, dtype, device, group, meter)

    def assemble(
        self, received: Tensor, prepared: dict[int, Tensor], meter: BufferMeter
    ) -> dict[int, Tensor]:
        """The blocks this rank computes, from the gather's buffer and its own ``prepared`` shards."""
        pieces: dict[int, list[tuple[Block, Tensor]]] = {m: [] for m in self.computed}
        for m, block, chunk in _chunks(received, self.gather_recv):
            pieces[m].append((block, chunk))
        for m, local, region in self.gather_self:
            pieces[m].append((region, prepared[m][local.slices]))
        return {
            m: _placed(
                meter.track(torch.empty(self.regions[m].shape, dtype=received.dtype, device=received.device)),
                pieces[m],
            )
            for m in self.computed
        }

    def launch_scatter(
        self,
        directions: dict[int, Tensor],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        meter: BufferMeter,
    ) -> tuple[Tensor, InFlight]:
        """Start returning every rank's pieces of this rank's computed ``directions``."""
        pieces = (directions[m][block.slices] for ps in self.scatter_send for m, block in ps)
        return _exchanged(
            pieces, self.scatter_send_sizes, self.scatter_recv_sizes, dtype, device, group, meter
        )

    def my_updates(
        self, received: Tensor | None, directions: dict[int, Tensor], dtype: torch.dtype
    ) -> dict[int, Tensor]:
        """This rank's shard of each member's direction: from the scatter and its own ``directions`` (in
        ``dtype``, as if sent); under ``sync``, cut out of the full directions."""
        if received is None:
            return {
                m: _local(shard, [(p.local, directions[m][p.block.slices]) for p in shard.pieces])
                for m, shard in self.my_shards.items()
                if shard.numel
            }
        pieces: dict[int, list[tuple[Block, Tensor]]] = {}
        for m, local, chunk in _chunks(received, self.scatter_recv):
            pieces.setdefault(m, []).append((local, chunk))
        for m, local, region in self.scatter_self:
            pieces.setdefault(m, []).append((local, directions[m][region.slices].to(dtype)))
        return {m: _local(self.my_shards[m], values) for m, values in pieces.items()}


def _exchanged(
    pieces: Iterable[Tensor],
    send_sizes: list[int],
    receive_sizes: list[int],
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
    meter: BufferMeter,
) -> tuple[Tensor, InFlight]:
    """One packed ``all_to_all_single`` of ``pieces``, launched; its receive buffer and handle."""
    send = meter.track(_packed(pieces, sum(send_sizes), dtype, device))
    receive = meter.track(torch.empty(sum(receive_sizes), dtype=dtype, device=device))
    return receive, InFlight(dist.all_to_all_single, receive, send, receive_sizes, send_sizes, group=group)


def _packed(pieces: Iterable[Tensor], numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``pieces`` in one flat buffer of ``dtype``, by one concatenation rather than a copy per piece."""
    flat = [piece.reshape(-1) for piece in pieces]
    assert sum(piece.numel() for piece in flat) == numel, f"{len(flat)} pieces for a buffer of {numel}"
    buffer = torch.empty(numel, dtype=dtype, device=device)
    if flat:
        torch.cat(flat, out=buffer)
    return buffer


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
    costs (``stats``) and the first exception of this rank's own work (``failure``)."""

    planned: PlannedMatrices
    rules: list[MatrixRule]
    state: dict[Tensor, State]
    team_groups: dict[tuple[int, ...], TeamGroup]
    batch_matrices: bool
    clock: Clock
    meter: BufferMeter
    stats: StepStats = field(default_factory=StepStats)
    failure: Exception | None = None

    def attempt(self, work: Callable[[], Any], fallback: Callable[[], Any] | None = None) -> Any:
        """``work()``, or ``fallback()`` once this step failed on this rank (kept in `failure`)."""
        if self.failure is None:
            try:
                return work()
            except Exception as error:
                self.failure = error
        return fallback() if fallback is not None else None

    def matrices(
        self,
        stepped: Sequence[bool],
        exchanges: Sequence[MicroGroupExchange],
        dtypes: Sequence[torch.dtype],
        overlap: bool,
    ) -> None:
        """Prepare, gather, compute, scatter and apply every micro-group (``stepped``: has a gradient)."""
        stepped_items = [stepped[item.entry] for item in self.planned.items]
        prepare = PreparedEntries(self, stepped)
        steps = [
            MicroGroupStep(self, exchange, dtype, prepare, stepped_items)
            for exchange, dtype in zip(exchanges, dtypes)
        ]
        with counting_retries() as retries:
            run_pipeline(steps, overlap)
        self.stats.decomposition_retries += retries()


class PreparedEntries:
    """Each matrix entry's elementwise part on this rank's shard, run once per step (a micro-group's
    entries together, one call per param group), dropped once its last item has taken its piece."""

    def __init__(
        self,
        run: StepRun,
        stepped: Sequence[bool],
    ) -> None:
        self.run, self.stepped = run, stepped
        self.prepared: dict[int, Tensor] = {}
        self.pending = [0] * len(stepped)
        for item in run.planned.items:
            self.pending[item.entry] += 1

    def __call__(self, indices: Sequence[int]) -> dict[int, Tensor]:
        """The pieces of plan items ``indices`` (a micro-group's members)."""
        items = self.run.planned.items
        self._prepare(sorted({items[m].entry for m in indices} - set(self.prepared)))
        pieces = {}
        for m in indices:
            item = items[m]
            prepared = self.prepared[item.entry]
            self.pending[item.entry] -= 1
            if not self.pending[item.entry]:
                del self.prepared[item.entry]
            if item.member is None:
                pieces[m] = prepared
            else:
                pieces[m] = prepared[item.local_index] if item.local_index is not None else prepared[:0]
        return pieces

    def _prepare(self, entries: list[int]) -> None:
        run, planned = self.run, self.run.planned
        by_group: dict[int, list[int]] = {}
        for entry in entries:
            if self.stepped[entry]:
                by_group.setdefault(id(planned.entries[entry].group), []).append(entry)
            else:  # joins the collectives with zeros; nobody computes or applies it
                local = local_tensor(planned.entries[entry].param)
                self.prepared[entry] = run.meter.track(torch.zeros_like(local))
        for batch in by_group.values():
            params = [planned.entries[entry].param for entry in batch]
            # A stack's items: see prepare_matrices.
            holds = [planned.holds_whole(planned.first_item[entry]) for entry in batch]
            state_dtype = planned.entries[batch[0]].group.get("state_dtype")
            work = functools.partial(
                prepare_matrices, params, run.rules[batch[0]], run.state, holds, state_dtype
            )
            zeros = functools.partial(_zeros_like_each, [local_tensor(param) for param in params])
            for entry, param, prepared in zip(batch, params, run.attempt(work, zeros)):
                # A rule may hand back its input or its state (Shampoo the gradient, Muon its
                # momentum): only a new tensor is memory of the step's own.
                held = [param.grad, *run.state.get(param, {}).values()]
                if all(local_tensor(t).data_ptr() != prepared.data_ptr() for t in held if t is not None):
                    run.meter.track(prepared)
                self.prepared[entry] = prepared


def _team_start(rule: MatrixRule, shape: tuple[int, ...], member: int, size: int) -> Callable[..., Any]:
    return lambda matrix, state: rule.team_direction(matrix, shape, member, size, state)


def _zeros_like_each(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [torch.zeros_like(t) for t in tensors]


class MicroGroupStep:
    """One micro-group's gather, compute, scatter and apply (`run_pipeline` calls them in order); each
    phase drops the buffers that later phases do not need."""

    def __init__(
        self,
        run: StepRun,
        exchange: MicroGroupExchange,
        dtype: torch.dtype,
        prepare: PreparedEntries,
        stepped: list[bool],
    ) -> None:
        self.run, self.exchange, self.dtype = run, exchange, dtype
        self.prepare, self.stepped = prepare, stepped
        self.device = run.planned.entries[0].param.device
        self.directions: dict[int, Tensor] = {}
        self.scattered: Tensor | None = None

    def launch_gather(self) -> None:
        # Prepared here, not for every group up front: the send buffer copies them at once.
        prepared = self.prepare(self.exchange.members)
        self.gathered, self.gather_work = self.exchange.launch_gather(
            prepared, self.dtype, self.device, self.run.planned.group, self.run.meter
        )
        self.own = {m: prepared[m] for m, _, _ in self.exchange.gather_self}  # not sent: see assemble
        self._count(self.gathered.element_size(), self.exchange.gather_send_sizes)

    def compute(self) -> None:
        stats, clock = self.run.stats, self.run.clock
        start = clock.mark()
        self.gather_work.wait()
        computing = clock.mark()
        stats.wait.add(start, computing)
        full = self.exchange.assemble(self.gathered, self.own, self.run.meter)
        del self.gathered, self.gather_work, self.own  # the receive buffer (the send buffer went at wait)
        in_teams = {m: full.pop(m) for m in list(full) if len(self.run.planned.team(m) or ()) > 1}
        # Teams first: their members start together (the gather synchronised them), and none
        # waits in a team's collective for another's own matrices.
        if in_teams:
            self._team_directions(in_teams)
        for members in self._batches(full):
            self._own_batch(members, full)
        stats.compute.add(computing, clock.mark())

    def _own_batch(self, members: list[int], full: dict[int, Tensor]) -> None:
        matrices = [full.pop(m) for m in members]
        zeros = functools.partial(_zeros_like_each, matrices)
        if self.stepped[members[0]]:
            work = functools.partial(self._direction, members, matrices)
            self.directions.update(zip(members, self.run.attempt(work, zeros)))
        else:
            self.directions.update(zip(members, zeros()))

    def _team_directions(self, slices: dict[int, Tensor]) -> None:
        """This rank's slices of the updates it computes in teams, all teams in lockstep."""
        run, planned = self.run, self.run.planned
        batches: dict[Any, list[int]] = {}
        for m in slices:
            rule = self._rule(m)
            alone = None if run.batch_matrices and rule.batches_matrices else m
            key = (planned.team(m), rule, planned.items[m].layout.shape, self.stepped[m], alone)
            batches.setdefault(key, []).append(m)
        runs, batched, states = [], [], []
        for (team, rule, shape, stepped, _), members in batches.items():
            matrices = [slices.pop(m) for m in members]
            if not stepped:
                self.directions.update(zip(members, _zeros_like_each(matrices)))
                continue
            member = team.index(planned.rank)
            start = _team_start(rule, shape, member, len(team))
            stacked = matrices[0] if len(members) == 1 else torch.stack(matrices)
            state = self._member_state(members[0], rule, member, len(team), stacked.device)
            runs.append(TeamRun(team, start, stacked, state))
            batched.append(members)
            states.append(state)
        failures = [state.get(FAILURES, 0) for state in states]
        results, collectives = run_teams(runs, run.team_groups, run.attempt, lambda: run.failure is not None)
        for members, result, state, before in zip(batched, results, states, failures):
            parts = [result] if len(members) == 1 else list(result.unbind(0))
            self.directions.update(zip(members, (run.meter.track(part) for part in parts)))
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

    def _batches(self, full: dict[int, Tensor]) -> list[list[int]]:
        """The computed items in batches for one call of their rule: same shape and rule, where it batches."""
        batches: dict[Any, list[int]] = {}
        batching = self.run.batch_matrices
        for m, matrix in full.items():
            rule = self._rule(m)
            key = (rule, matrix.shape, self.stepped[m]) if batching and rule.batches_matrices else m
            batches.setdefault(key, []).append(m)
        return list(batches.values())

    def _direction(self, members: list[int], matrices: list[Tensor]) -> list[Tensor]:
        stats = self.run.stats
        if len(members) > 1:  # one batched call; the rule keeps no matrix state
            stacked = torch.stack([as_matrix(matrix) for matrix in matrices])
            direction = self.run.meter.track(self._rule(members[0]).direction(stacked, {}))
            stats.matrices_computed += len(members)
            return [part.reshape(matrices[0].shape) for part in direction.unbind(0)]
        (m,), (matrix,) = members, matrices
        item = self.run.planned.items[m]
        param_state = self.run.state[self.run.planned.entries[item.entry].param]
        failures = param_state.get(FAILURES, 0)
        if item.member is None:
            direction = self._rule(m).direction(as_matrix(matrix), param_state).reshape(matrix.shape)
        else:
            direction = member_direction(self._rule(m), matrix, param_state, item.member)
        stats.matrices_computed += 1
        stats.decomposition_failures += param_state.get(FAILURES, 0) - failures
        return [self.run.meter.track(direction)]

    def launch_scatter(self) -> None:
        if self.exchange.scatters:
            self.scattered, self.scatter_work = self.exchange.launch_scatter(
                self.directions, self.dtype, self.device, self.run.planned.group, self.run.meter
            )
            self._count(self.scattered.element_size(), self.exchange.scatter_send_sizes)
            # Packed into the send buffer, but for this rank's own pieces (under sync all of
            # them are its updates).
            own = {m for m, _, _ in self.exchange.scatter_self}
            self.directions = {m: d for m, d in self.directions.items() if m in own}

    def finish(self) -> None:
        if self.scattered is not None:
            clock = self.run.clock
            start = clock.mark()
            self.scatter_work.wait()
            self.run.stats.wait.add(start, clock.mark())
        run, planned = self.run, self.run.planned
        by_group: dict[int, list[tuple[Item, Tensor]]] = {}  # one call of the rule per param group
        for m, update in self.exchange.my_updates(self.scattered, self.directions, self.dtype).items():
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
        self.directions, self.scattered, self.scatter_work = {}, None, None

    def _count(self, element_bytes: int, send_sizes: list[int]) -> None:
        self.run.stats.all_to_alls += 1
        # What leaves this rank: its block for itself stays in memory.
        others = sum(send_sizes) - send_sizes[self.run.planned.rank]
        self.run.stats.bytes_sent += element_bytes * others


def run_pipeline(steps: Sequence[MicroGroupStep], overlap: bool) -> None:
    """Run every micro-group's phases, pipelined when ``overlap``, with the collectives in the same
    order on every rank::

        gather 0, gather 1, [compute 0], scatter 0, gather 2, [compute 1], scatter 1, [apply 0], …
    """
    if not overlap:
        for step in steps:
            step.launch_gather()
            step.compute()
            step.launch_scatter()
            step.finish()
        return
    if steps:
        steps[0].launch_gather()
    for index, step in enumerate(steps):
        if index + 1 < len(steps):
            steps[index + 1].launch_gather()
        step.compute()
        step.launch_scatter()
        if index > 0:
            steps[index - 1].finish()
    if steps:
        steps[-1].finish()
