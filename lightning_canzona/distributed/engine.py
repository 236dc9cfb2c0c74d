"""The engine: exact, non-redundant updates of the DTensor parameters on one device mesh.

Per step, on every rank of the mesh, in the same order:

1. (before, once per step for all meshes: `lightning_canzona.distributed.gradients`) the ranks
   agree on every gradient: a parameter without a gradient on every rank is skipped, as on one
   device; the others have a gradient in their parameter's layout on every rank;
2. AdamW parameters step elementwise on their shards;
3. every matrix's elementwise part (`MatrixRule.prepare`) runs on its shards;
4. the micro-groups run through the pipeline: one packed all-to-all gathers the shards to the
   owners, each owner computes the full updates of its matrices (`MatrixRule.direction`), one packed
   all-to-all returns the update blocks, every rank applies its blocks (`MatrixRule.apply`).
   A matrix that the plan gives to a team goes to its members in slices, and they compute its
   update together (`MatrixRule.team_direction`, `lightning_canzona.distributed.teams`).

Elementwise state (momentum, Adam moments) is a DTensor sharded like its parameter. Matrix state
(Shampoo/SOAP factors and bases, step counters) lives on the owner, in full, and nowhere else; a
team's members hold their slices of its moments and the whole of the rest. The plan is built once
and rebuilt only when the parameter set changes; matrix state whose owner changes then moves to
the new owner (or team).

An exception in this rank's own work (an update rule, out of memory) must not leave the other
ranks waiting in a collective: it is kept in `MeshEngine.failure`, this rank joins the rest of
the step's collectives with zeros, and the caller raises it on every rank once the step's
collectives are done (`lightning_canzona.distributed.failures`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_canzona.distributed import pipeline
from lightning_canzona.distributed.clock import Clock, Intervals
from lightning_canzona.distributed.exchange import MicroGroupExchange
from lightning_canzona.distributed.layout import (
    Block,
    MatrixLayout,
    exchange_layouts,
    holders,
    local_tensor,
    stack_member,
)
from lightning_canzona.distributed.memory import BufferMeter
from lightning_canzona.distributed.teams import TeamGroup, TeamRun, joined_state, member_state, run_teams
from lightning_canzona.distributed.updates import (
    apply_matrices,
    member_direction,
    member_prefix,
    prepare_matrices,
    step_adamw,
)
from lightning_canzona.geometry import long_dim, member_blocks
from lightning_canzona.planning import Plan, PlanSettings, block_of, build_plan
from lightning_canzona.planning.matrices import matrix_spec
from lightning_canzona.planning.teams import local_members
from lightning_canzona.rules.adamw import ALGORITHM as ADAMW
from lightning_canzona.rules.base import MatrixRule, state_part, store_state_part
from lightning_canzona.rules.kronecker import FAILURES

State = dict[str, Tensor]


@dataclass
class StepStats:
    """What one optimizer step cost this rank, timed on the device (see `clock`).

    Attributes:
        step: The whole step: AdamW, preparation, the micro-group pipeline, the apply.
        compute: The full-matrix updates this rank owns.
        wait: Blocked on gathers and scatters: communication that compute did not hide.
        matrices_computed: Full-matrix updates this rank computed.
        decomposition_failures: Factor decompositions that failed in this step's updates (the
            previous root or basis was kept; see `lightning_canzona.rules.kronecker`).
        bytes_sent: Bytes this rank sent to other ranks in all-to-alls.
        all_to_alls: All-to-all collectives issued.
        peak_buffer_bytes: Most bytes of the step's own buffers alive at once (prepared shards,
            all-to-all buffers, full matrices, directions; see `memory.BufferMeter`).
        team_matrices: Matrices whose update this rank computed a slice of, in a team.
        team_collectives: Collectives among team members that this rank took part in.
    """

    step: Intervals = field(default_factory=Intervals)
    compute: Intervals = field(default_factory=Intervals)
    wait: Intervals = field(default_factory=Intervals)
    matrices_computed: int = 0
    decomposition_failures: int = 0
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
        self.bytes_sent += other.bytes_sent
        self.all_to_alls += other.all_to_alls
        self.team_matrices += other.team_matrices
        self.team_collectives += other.team_collectives
        # Meshes step one after another: their buffers are never alive together.
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, other.peak_buffer_bytes)


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


def _items(entries: Sequence[Entry], layouts: Sequence[MatrixLayout], rank: int) -> list[Item]:
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


def mesh_process_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group spanning all ranks of ``mesh``."""
    if mesh.ndim == 1:
        return mesh.get_group(0)
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    raise ValueError(
        f"lightning_canzona needs a {mesh.ndim}-D device mesh to span all {dist.get_world_size()} "
        f"ranks; this one has {mesh.size()} ({mesh})."
    )


def mesh_sizes(mesh: DeviceMesh) -> tuple[int, int]:
    """``(dp, tp)`` of a mesh, for reports: a 2-D mesh is (dp, tp); a 1-D mesh is DP unless named TP."""
    if mesh.ndim == 2:
        return mesh.size(0), mesh.size(1)
    names = mesh.mesh_dim_names or ()
    is_tp = any("tp" in name or "tensor" in name for name in names)
    return (1, mesh.size()) if is_tp else (mesh.size(), 1)


class MeshEngine:
    """Runs the optimizer step for all DTensor parameters that live on one device mesh.

    Args:
        mesh: The parameters' device mesh.
        settings: How to plan.
        overlap: Pipeline the micro-groups.
        batch_matrices: Update an owner's same-shape matrices of a micro-group in one call of
            their rule where it allows (`MatrixRule.batches_matrices`); ``False`` calls it once per
            matrix (the baseline that ``canzona bench step`` compares with).
        flops_weights: What a FLOP of each matmul dtype costs in FLOPs of the plan's unit
            (`distributed.teams.flops_weights`): each matrix's FLOPs are weighted by its rule's
            dtype, so that one plan balances rules that multiply in different dtypes by time.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        settings: PlanSettings,
        overlap: bool,
        batch_matrices: bool = True,
        flops_weights: dict[torch.dtype, float] | None = None,
    ) -> None:
        self.mesh, self.settings, self.overlap = mesh, settings, overlap
        self.batch_matrices = batch_matrices
        self.flops_weights = flops_weights or {}
        self.group = mesh_process_group(mesh)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.world < dist.get_world_size():
            # Every rank of the job creates every team's process group (dist.new_group): a mesh
            # on a slice of the job cannot ask the other ranks to, so its matrices stay whole.
            self.settings = replace(settings, max_team=1)
        self.plan: Plan | None = None
        self._key: tuple | None = None
        self._entries: list[Entry] = []
        #: The matrices the plan covers (plan index = item index) and each entry's first item.
        self._items: list[Item] = []
        self._first_item: list[int] = []
        self._exchanges: list[MicroGroupExchange] = []
        self._exchange_dtypes: list[torch.dtype] = []
        #: Costs of the latest step on this rank.
        self.stats = StepStats()
        #: The first exception of this rank's work in the latest step (see the module docstring).
        self.failure: Exception | None = None
        self.clock = Clock(torch.device(mesh.device_type))
        self.meter = BufferMeter()
        #: The process group of every team that a plan had, by its ranks in member order.
        self.team_groups: dict[tuple[int, ...], TeamGroup] = {}

    def owner(self, index: int) -> int | None:
        """Owner group-rank of plan item ``index`` (``None`` under ``sync``)."""
        assert self.plan is not None
        return None if self.plan.owners is None else self.plan.owners[index]

    def holds_whole(self, index: int) -> bool:
        """Whether this rank computes plan item ``index`` alone, and so holds its matrix state
        whole (everyone under ``sync``)."""
        team = self.team(index)
        return team is None or team == (self.rank,)

    def step(
        self,
        entries: Sequence[Entry],
        has_grad: Sequence[bool],
        state: dict[Tensor, State],
        rule_of: Callable[[dict[str, Any]], MatrixRule],
    ) -> None:
        """One optimizer step of ``entries`` (all on this engine's mesh).

        ``has_grad`` tells, per entry, whether it has a gradient (on every rank, see
        `lightning_canzona.distributed.gradients.agree_on_gradients`). An exception of this
        rank's own work ends up in `failure` instead of being raised.
        """
        self.stats = StepStats()
        self.failure = None
        self.meter.restart()
        start = self.clock.mark()
        matrices = [entry for entry in entries if entry.algorithm != ADAMW]
        rules = entry_rules(matrices, rule_of)
        self._ensure_plan(matrices, rules, state)
        adamw: dict[int, list[Entry]] = {}  # by param group: one foreach step each
        for entry, stepped in zip(entries, has_grad):
            if entry.algorithm == ADAMW and stepped:
                adamw.setdefault(id(entry.group), []).append(entry)
        for group in adamw.values():
            params, names = [entry.param for entry in group], [entry.name for entry in group]
            self.attempt(functools.partial(step_adamw, params, names, state, group[0].group))
        stepped_entries = [flag for entry, flag in zip(entries, has_grad) if entry.algorithm != ADAMW]
        stepped = [stepped_entries[item.entry] for item in self._items]
        prepare = _PreparedEntries(self, rules, state, stepped_entries)
        steps = [
            _GroupStep(self, exchange, dtype, rules, prepare, stepped, state)
            for exchange, dtype in zip(self._exchanges, self._exchange_dtypes)
        ]
        pipeline.run(steps, self.overlap)
        self.stats.step.add(start, self.clock.mark())
        self.stats.peak_buffer_bytes = self.meter.peak

    def attempt(self, work: Callable[[], Tensor | None], fallback: Callable[[], Tensor] | None = None) -> Any:
        """``work()``, or ``fallback()`` once this step failed on this rank (kept in `failure`)."""
        if self.failure is None:
            try:
                return work()
            except Exception as error:
                self.failure = error
        return fallback() if fallback is not None else None

    def prepare(
        self,
        entries: Sequence[Entry],
        state: dict[Tensor, State],
        rule_of: Callable[[dict[str, Any]], MatrixRule],
    ) -> Plan:
        """Build the plan (sharing the layouts once) if the matrices changed, and return it.

        Collective on the first call and whenever the parameter set changed.
        """
        matrices = [entry for entry in entries if entry.algorithm != ADAMW]
        self._ensure_plan(matrices, entry_rules(matrices, rule_of), state)
        assert self.plan is not None
        return self.plan

    def _ensure_plan(
        self, matrices: list[Entry], rules: list[MatrixRule], state: dict[Tensor, State]
    ) -> None:
        key = tuple((id(entry.param), tuple(entry.param.shape), rule) for entry, rule in zip(matrices, rules))
        if key == self._key:
            # Same matrices, but the param groups may be new dicts (load_state_dict replaces
            # them): hyperparameters such as a scheduled lr must be read from the current ones.
            self._entries = matrices
            return
        previous_teams = (
            {self._item_key(i): self.team(i) for i in range(len(self._items))} if self.plan else {}
        )
        layouts = exchange_layouts(
            [e.name for e in matrices], [e.param for e in matrices], self.mesh, self.group
        )
        self._items = _items(matrices, layouts, self.rank)
        self._first_item = [0] * len(matrices)
        for index in reversed(range(len(self._items))):
            self._first_item[self._items[index].entry] = index
        specs = [
            matrix_spec(
                matrices[item.entry].name + ("" if item.member is None else f"[{item.member}]"),
                item.layout.shape,
                rules[item.entry],
                block_of(matrices[item.entry].name),
                holders(item.layout),
            ).weighted(self.flops_weights.get(rules[item.entry].matmul_dtype(), 1.0))
            for item in self._items
        ]
        self.plan = self._local_team_members(build_plan(specs, *mesh_sizes(self.mesh), self.settings))
        self._entries, self._key = matrices, key
        item_layouts = [item.layout for item in self._items]
        self._exchanges = [
            MicroGroupExchange(members, item_layouts, self.plan.teams, self.rank, self.world)
            for members in self.plan.micro_groups
        ]
        # Each group travels in one dtype, wide enough for every member's rule.
        self._exchange_dtypes = [
            functools.reduce(
                torch.promote_types,
                (
                    rules[self._items[m].entry].exchange_dtype(matrices[self._items[m].entry].param.dtype)
                    for m in members
                ),
            )
            for members in self.plan.micro_groups
        ]
        self._create_team_groups()
        self._move_matrix_state(previous_teams, rules, state)

    def _local_team_members(self, plan: Plan) -> Plan:
        """``plan`` with each team's members on the ranks that hold their slices, where members
        that cost alike can trade ranks (`planning.teams.local_members`)."""
        if plan.teams is None:
            return plan
        teams = []
        for index, team in enumerate(plan.teams):
            if len(team) > 1:
                layout = self._items[index].layout
                slices = [Block(*block) for block in member_blocks(layout.shape, len(team))]
                held = [[layout.held_numel(rank, block) for rank in team] for block in slices]
                loads = list(zip(plan.loads[index], plan.steady[index], plan.peaks[index]))
                team = local_members(team, loads, held)
            teams.append(team)
        if tuple(teams) == plan.teams:
            return plan
        return replace(plan, teams=tuple(teams), owners=tuple(team[0] for team in teams))

    def _create_team_groups(self) -> None:
        """A process group for every set of ranks that forms a team of the plan (collective:
        every rank of the job creates every group, in the same order; kept across plans)."""
        assert self.plan is not None
        groups = {frozenset(team): group.group for team, group in self.team_groups.items()}
        for team in sorted({team for team in self.plan.teams or () if len(team) > 1}):
            members = [dist.get_global_rank(self.group, rank) for rank in team]
            if frozenset(team) not in groups:
                groups[frozenset(team)] = dist.new_group(sorted(members))
            # A new group numbers its ranks in the order of their global ranks.
            ranks_in_group = tuple(sorted(members).index(rank) for rank in members)
            self.team_groups[team] = TeamGroup(groups[frozenset(team)], ranks_in_group)

    def team(self, index: int) -> tuple[int, ...] | None:
        """The ranks that compute plan item ``index`` (``None`` under ``sync``)."""
        assert self.plan is not None
        return None if self.plan.teams is None else self.plan.teams[index]

    def _item_key(self, index: int) -> tuple[int, int | None]:
        item = self._items[index]
        return id(self._entries[item.entry].param), item.member

    def _item_state_keys(
        self, index: int, rules: Sequence[MatrixRule], state: dict[Tensor, State]
    ) -> list[str]:
        """The keys of item ``index``'s matrix state in its parameter's state: all of it, or
        those of one matrix of a stack (`updates.member_prefix`)."""
        item = self._items[index]
        keys = list(rules[item.entry].matrix_state(state.get(self._entries[item.entry].param, {})))
        if item.member is None:
            return keys
        return [key for key in keys if key.startswith(member_prefix(item.member))]

    def _move_matrix_state(
        self,
        previous_teams: dict[tuple[int, int | None], tuple[int, ...] | None],
        rules: list[MatrixRule],
        state: dict[Tensor, State],
    ) -> None:
        """Hand matrix state over where a rebuilt plan gave a matrix to other ranks (collective)."""
        for index in range(len(self._items)):
            old = previous_teams.get(self._item_key(index), self.team(index))
            if old != self.team(index):
                self._hand_over(index, old, self.team(index), rules, state)
        self.drop_foreign_matrix_state(state, rules)
        if not previous_teams:  # the first plan: any state is a loaded checkpoint's
            self.keep_loaded_stack_failures_on_one_owner(state)

    def _hand_over(
        self,
        index: int,
        old: tuple[int, ...] | None,
        new: tuple[int, ...] | None,
        rules: Sequence[MatrixRule],
        state: dict[Tensor, State],
    ) -> None:
        """Move item ``index``'s matrix state from the ranks ``old`` to the ranks ``new`` (an
        owner holds it whole, a team's members in slices; ``None``: every rank whole, as under
        ``sync``). Collective over the mesh: every source broadcasts what it holds."""
        item = self._items[index]
        param = self._entries[item.entry].param
        held = state.get(param, {})
        mine = {key: held.pop(key) for key in self._item_state_keys(index, rules, state)}
        parts = []
        for source in (0,) if old is None else old:
            payload = [mine if source == self.rank else None]
            source_rank = dist.get_global_rank(self.group, source)
            dist.broadcast_object_list(payload, src=source_rank, group=self.group)
            parts.append(payload[0] or {})
        if new is not None and self.rank not in new or not parts[0]:
            return
        sliced = self._sliced_keys(index, rules)
        whole = parts[0] if len(parts) == 1 else joined_state(parts, sliced, item.layout.shape)
        if new is not None and len(new) > 1:
            whole = member_state(whole, sliced, item.layout.shape, new.index(self.rank), len(new))
        state.setdefault(param, {}).update({key: value.to(param.device) for key, value in whole.items()})

    def _sliced_keys(self, index: int, rules: Sequence[MatrixRule]) -> set[str]:
        """The keys of item ``index``'s state that a team member holds a slice of."""
        item = self._items[index]
        prefix = "" if item.member is None else member_prefix(item.member)
        return {prefix + key for key in rules[item.entry].team_sliced_keys(item.layout.shape)}

    def _stateful_team_items(self, rules: Sequence[MatrixRule]) -> list[int]:
        """The plan items that a team computes and whose members hold slices of matrix state."""
        return [
            index
            for index, item in enumerate(self._items)
            if len(self.team(index) or ()) > 1 and rules[item.entry].team_sliced_keys(item.layout.shape)
        ]

    def drop_foreign_matrix_state(self, state: dict[Tensor, State], rules: Sequence[MatrixRule]) -> None:
        """Keep only the matrix state that this rank holds under the plan (a full, single-file
        checkpoint loads every owner's state on every rank): a team member its slice of it."""
        for index, item in enumerate(self._items):
            if self.owner(index) is None:
                continue
            held = state.get(self._entries[item.entry].param, {})
            keys = self._item_state_keys(index, rules, state)
            team = self.team(index) or ()
            if self.rank not in team:
                for key in keys:
                    del held[key]
            elif len(team) > 1 and self._is_whole(index, rules, held):
                member = member_state(
                    {key: held[key] for key in keys},
                    self._sliced_keys(index, rules),
                    item.layout.shape,
                    team.index(self.rank),
                    len(team),
                )
                held.update(member)

    def keep_loaded_stack_failures_on_one_owner(self, state: dict[Tensor, State]) -> None:
        """After a load, leave a stack's failure count (one per parameter, the total of its
        owners' in a checkpoint) with the owner of the stack's first matrix only: the other
        owners count theirs from zero, and the next checkpoint adds them up
        (`owned_matrix_state`)."""
        first_owner: dict[int, int | None] = {}
        for index, item in enumerate(self._items):
            if item.member is not None:
                first_owner.setdefault(item.entry, self.owner(index))
        for entry, owner in first_owner.items():
            if owner is not None and owner != self.rank:
                state.get(self._entries[entry].param, {}).pop(FAILURES, None)

    def _is_whole(self, index: int, rules: Sequence[MatrixRule], held: State) -> bool:
        """Whether ``held`` has item ``index``'s sliced state at the matrix's whole shape."""
        shape = tuple(self._items[index].layout.shape)
        dim = long_dim(shape)
        sliced = [held[key] for key in self._sliced_keys(index, rules) if key in held]
        return bool(sliced) and all(value.shape[dim] == shape[dim] for value in sliced)

    def gather_team_state(self, state: dict[Tensor, State], rules: Sequence[MatrixRule]) -> None:
        """Put the matrix state of every matrix computed by a team whole on the team's first
        member (its owner of record), as a checkpoint holds it (collective)."""
        for index in self._stateful_team_items(rules):
            team = self.team(index)
            assert team is not None
            self._hand_over(index, team, team[:1], rules, state)

    def scatter_team_state(self, state: dict[Tensor, State], rules: Sequence[MatrixRule]) -> None:
        """Give every team's members their slices of the state that its first member holds whole
        (`gather_team_state`, or a loaded checkpoint); state already in slices stays (collective)."""
        for index in self._stateful_team_items(rules):
            team = self.team(index)
            assert team is not None
            held = state.get(self._entries[self._items[index].entry].param, {})
            whole = [self.rank == team[0] and self._is_whole(index, rules, held)]
            dist.broadcast_object_list(whole, src=dist.get_global_rank(self.group, team[0]), group=self.group)
            if whole[0]:
                self._hand_over(index, team[:1], team, rules, state)

    def owned_matrix_state(self, state: dict[Tensor, State], rules: Sequence[MatrixRule]) -> dict[int, State]:
        """This rank's matrix state of the matrices it owns (a team's first member: its part, or
        the whole after `gather_team_state`), by index of the parameter among the engine's entries.

        A stack whose matrices several ranks own has a failure count on each: a checkpoint holds
        their sum (`lightning_canzona.checkpoint.full_optimizer_state`)."""
        if self.plan is None or self.plan.owners is None:
            return {}
        owned: dict[int, State] = {}
        for index, item in enumerate(self._items):
            if self.owner(index) == self.rank:
                held = state.get(self._entries[item.entry].param, {})
                part = {key: held[key] for key in self._item_state_keys(index, rules, state)}
                if item.member is not None and FAILURES in held:
                    part[FAILURES] = held[FAILURES]
                owned.setdefault(item.entry, {}).update(part)
        return {entry: part for entry, part in owned.items() if part}


class _PreparedEntries:
    """Each matrix entry's elementwise part on this rank's shard, run once per step, and each
    item's piece of it: what the item's gather sends. The entries of a micro-group that are not
    prepared yet are prepared together, one call of their rule per param group; an entry's
    result is dropped once its last item has taken its piece."""

    def __init__(
        self,
        engine: MeshEngine,
        rules: Sequence[MatrixRule],
        state: dict[Tensor, State],
        stepped: Sequence[bool],
    ) -> None:
        self.engine, self.rules, self.state, self.stepped = engine, rules, state, stepped
        self.prepared: dict[int, Tensor] = {}
        self.pending = [0] * len(stepped)
        for item in engine._items:
            self.pending[item.entry] += 1

    def __call__(self, indices: Sequence[int]) -> dict[int, Tensor]:
        """The pieces of plan items ``indices`` (a micro-group's members)."""
        items = self.engine._items
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
        engine = self.engine
        by_group: dict[int, list[int]] = {}
        for entry in entries:
            if self.stepped[entry]:
                by_group.setdefault(id(engine._entries[entry].group), []).append(entry)
            else:  # joins the collectives with zeros; nobody computes or applies it
                local = local_tensor(engine._entries[entry].param)
                self.prepared[entry] = engine.meter.track(torch.zeros_like(local))
        for batch in by_group.values():
            params = [engine._entries[entry].param for entry in batch]
            # A stack's items: see prepare_matrices.
            holds = [engine.holds_whole(engine._first_item[entry]) for entry in batch]
            work = functools.partial(prepare_matrices, params, self.rules[batch[0]], self.state, holds)
            zeros = functools.partial(_zeros_like_each, [local_tensor(param) for param in params])
            for entry, param, prepared in zip(batch, params, engine.attempt(work, zeros)):
                # A rule may hand back its input or its state (Shampoo the gradient, Muon its
                # momentum): only a new tensor is memory of the step's own.
                held = [param.grad, *self.state.get(param, {}).values()]
                if all(local_tensor(t).data_ptr() != prepared.data_ptr() for t in held if t is not None):
                    engine.meter.track(prepared)
                self.prepared[entry] = prepared


def _team_start(rule: MatrixRule, shape: tuple[int, ...], member: int, size: int) -> Callable[..., Any]:
    """Starts ``rule``'s team computation of a matrix of ``shape`` on a member's slices and state."""
    return lambda matrix, state: rule.team_direction(matrix, shape, member, size, state)


def _zeros_like_each(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [torch.zeros_like(t) for t in tensors]


class _GroupStep:
    """One micro-group's gather, compute, scatter and apply (see `pipeline.GroupStep`).

    Each phase drops the buffers that later phases do not need, so that the step holds the
    buffers of the groups in flight only, not of every group until the step ends.
    """

    def __init__(
        self,
        engine: MeshEngine,
        exchange: MicroGroupExchange,
        dtype: torch.dtype,
        rules: list[MatrixRule],
        prepare: _PreparedEntries,
        stepped: list[bool],
        state: dict[Tensor, State],
    ) -> None:
        self.engine, self.exchange, self.dtype, self.rules = engine, exchange, dtype, rules
        self.prepare, self.stepped, self.state = prepare, stepped, state
        self.device = engine._entries[0].param.device
        self.directions: dict[int, Tensor] = {}
        self.scattered: Tensor | None = None

    def launch_gather(self) -> None:
        # Prepared here, not for every group up front: the send buffer copies them at once.
        prepared = self.prepare(self.exchange.members)
        self.gathered, self.gather_work = self.exchange.launch_gather(
            prepared, self.dtype, self.device, self.engine.group, self.engine.meter
        )
        self.own = {m: prepared[m] for m, _, _ in self.exchange.gather_self}  # not sent: see assemble
        self._count(self.gathered.element_size(), self.exchange.gather_send_sizes)

    def compute(self) -> None:
        stats, clock = self.engine.stats, self.engine.clock
        start = clock.mark()
        self.gather_work.wait()
        computing = clock.mark()
        stats.wait.add(start, computing)
        full = self.exchange.assemble(self.gathered, self.own, self.engine.meter)
        del self.gathered, self.gather_work, self.own  # the receive buffer (the send buffer went at wait)
        in_teams = {m: full.pop(m) for m in list(full) if len(self.engine.team(m) or ()) > 1}
        # Teams first: their members start together (the gather synchronised them), and none
        # waits in a team's collective for another's own matrices.
        if in_teams:
            self._team_directions(in_teams)
        for members in self._batches(full):
            self._own_batch(members, full)
        stats.compute.add(computing, clock.mark())

    def _own_batch(self, members: list[int], full: dict[int, Tensor]) -> None:
        """The directions of one batch of matrices that this rank computes alone."""
        matrices = [full.pop(m) for m in members]
        zeros = functools.partial(_zeros_like_each, matrices)
        if self.stepped[members[0]]:
            work = functools.partial(self._direction, members, matrices)
            self.directions.update(zip(members, self.engine.attempt(work, zeros)))
        else:
            self.directions.update(zip(members, zeros()))

    def _team_directions(self, slices: dict[int, Tensor]) -> None:
        """The slices of the updates that this rank computes in teams: per team, same-shape
        matrices of a rule without matrix state in one batched computation, all teams in
        lockstep (`distributed.teams`)."""
        engine = self.engine
        batches: dict[Any, list[int]] = {}
        for m in slices:
            rule = self._rule(m)
            alone = None if engine.batch_matrices and rule.batches_matrices else m
            key = (engine.team(m), rule, engine._items[m].layout.shape, self.stepped[m], alone)
            batches.setdefault(key, []).append(m)
        runs, batched, states = [], [], []
        for (team, rule, shape, stepped, _), members in batches.items():
            matrices = [slices.pop(m) for m in members]
            if not stepped:
                self.directions.update(zip(members, _zeros_like_each(matrices)))
                continue
            member = team.index(engine.rank)
            start = _team_start(rule, shape, member, len(team))
            stacked = matrices[0] if len(members) == 1 else torch.stack(matrices)
            state = self._member_state(members[0], rule, member, len(team), stacked.device)
            runs.append(TeamRun(team, start, stacked, state))
            batched.append(members)
            states.append(state)
        failures = [int(state.get(FAILURES, 0)) for state in states]
        results, collectives = run_teams(
            runs, engine.team_groups, engine.attempt, lambda: engine.failure is not None
        )
        for members, result, state, before in zip(batched, results, states, failures):
            parts = [result] if len(members) == 1 else list(result.unbind(0))
            self.directions.update(zip(members, (engine.meter.track(part) for part in parts)))
            engine.stats.team_matrices += len(members)
            engine.stats.decomposition_failures += int(state.get(FAILURES, 0)) - before
            if state:
                self._store_member_state(members[0], state)
        engine.stats.team_collectives += collectives

    def _member_state(self, m: int, rule: MatrixRule, member: int, size: int, device: torch.device) -> State:
        """This member's matrix state of team item ``m`` (created on first use), or ``{}`` for a
        batch of a rule without matrix state."""
        if rule.batches_matrices:
            return {}
        item = self.engine._items[m]
        param_state = self.state.setdefault(self.engine._entries[item.entry].param, {})
        prefix = "" if item.member is None else member_prefix(item.member)
        part = state_part(param_state, prefix) if prefix else rule.matrix_state(param_state)
        if all(key == FAILURES for key in part):
            part.update(rule.init_team_state(item.layout.shape, member, size, device))
        return part

    def _store_member_state(self, m: int, part: State) -> None:
        item = self.engine._items[m]
        param_state = self.state[self.engine._entries[item.entry].param]
        store_state_part(param_state, "" if item.member is None else member_prefix(item.member), part)

    def _rule(self, m: int) -> MatrixRule:
        return self.rules[self.engine._items[m].entry]

    def _batches(self, full: dict[int, Tensor]) -> list[list[int]]:
        """The computed items, in batches that one call of their rule updates: matrices of the
        same shape and rule (`MatrixRule.batches_matrices`: stacked, they are a stack), else one."""
        batches: dict[Any, list[int]] = {}
        batching = self.engine.batch_matrices
        for m, matrix in full.items():
            rule = self._rule(m)
            key = (rule, matrix.shape, self.stepped[m]) if batching and rule.batches_matrices else m
            batches.setdefault(key, []).append(m)
        return list(batches.values())

    def _direction(self, members: list[int], matrices: list[Tensor]) -> list[Tensor]:
        stats = self.engine.stats
        if len(members) > 1:  # one batched call; the rule keeps no matrix state
            direction = self.engine.meter.track(self._rule(members[0]).direction(torch.stack(matrices), {}))
            stats.matrices_computed += len(members)
            return list(direction.unbind(0))
        (m,), (matrix,) = members, matrices
        item = self.engine._items[m]
        param_state = self.state[self.engine._entries[item.entry].param]
        failures = int(param_state.get(FAILURES, 0))
        if item.member is None:
            direction = self._rule(m).direction(matrix, param_state)
        else:
            direction = member_direction(self._rule(m), matrix, param_state, item.member)
        stats.matrices_computed += 1
        stats.decomposition_failures += int(param_state.get(FAILURES, 0)) - failures
        return [self.engine.meter.track(direction)]

    def launch_scatter(self) -> None:
        if self.exchange.scatters:
            self.scattered, self.scatter_work = self.exchange.launch_scatter(
                self.directions, self.dtype, self.device, self.engine.group, self.engine.meter
            )
            self._count(self.scattered.element_size(), self.exchange.scatter_send_sizes)
            # Packed into the send buffer, but for this rank's own pieces (under sync all of
            # them are its updates).
            own = {m for m, _, _ in self.exchange.scatter_self}
            self.directions = {m: d for m, d in self.directions.items() if m in own}

    def finish(self) -> None:
        if self.scattered is not None:
            clock = self.engine.clock
            start = clock.mark()
            self.scatter_work.wait()
            self.engine.stats.wait.add(start, clock.mark())
        engine = self.engine
        by_group: dict[int, list[tuple[Item, Tensor]]] = {}  # one call of the rule per param group
        for m, update in self.exchange.my_updates(self.scattered, self.directions, self.dtype).items():
            if self.stepped[m]:
                item = engine._items[m]
                by_group.setdefault(id(engine._entries[item.entry].group), []).append((item, update))
        for updates in by_group.values():
            entries = [engine._entries[item.entry] for item, _ in updates]
            work = functools.partial(
                apply_matrices,
                [entry.param for entry in entries],
                [entry.name for entry in entries],
                self.rules[updates[0][0].entry],
                [update for _, update in updates],
                entries[0].group,
                [item.local_index for item, _ in updates],
            )
            engine.attempt(work)
        self.directions, self.scattered, self.scatter_work = {}, None, None

    def _count(self, element_bytes: int, send_sizes: list[int]) -> None:
        self.engine.stats.all_to_alls += 1
        # What leaves this rank: its block for itself stays in memory.
        others = sum(send_sizes) - send_sizes[self.engine.rank]
        self.engine.stats.bytes_sent += element_bytes * others
