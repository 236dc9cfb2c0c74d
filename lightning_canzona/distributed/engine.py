"""The engine: one mesh's DTensor parameters, planned, stepped, and their matrix state kept.

`MeshEngine` is what the optimizer talks to, one per device mesh: it plans at the first step (and
again when the parameter set changes, moving matrix state: `custody`), runs each step
(`runtime.StepRun`) and serves the optimizer's state dict.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_canzona.config import PlanConfig
from lightning_canzona.distributed.agreement import raise_if_failed_anywhere
from lightning_canzona.distributed.custody import MatrixStateCustody
from lightning_canzona.distributed.layout import Block, MatrixLayout, exchange_layouts, holders
from lightning_canzona.distributed.prices import flops_weights, priced
from lightning_canzona.distributed.runtime import (
    BufferMeter,
    Clock,
    Entry,
    Item,
    MicroGroupExchange,
    PlannedMatrices,
    StepLayout,
    StepRun,
    StepStats,
    build_items,
    step_adamw,
)
from lightning_canzona.distributed.team_collectives import TeamGroup
from lightning_canzona.geometry import member_blocks
from lightning_canzona.planning import Plan, PlanSettings, block_of, build_plan
from lightning_canzona.planning.matrices import local_members, matrix_spec
from lightning_canzona.planning.memory import GroupBuffers, size_text
from lightning_canzona.planning.replication import (
    ReplicationChoice,
    choose_replication,
    priced_for,
)
from lightning_canzona.planning.report import over_budget
from lightning_canzona.rules.base import MatrixRule, State


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


def replica_ranks(mesh: DeviceMesh) -> tuple[tuple[int, ...], ...] | None:
    """Each HSDP replica's global ranks, sorted, where the mesh has a dimension named ``*replicate*``
    of more than one; else ``None``."""
    dims = [d for d, name in enumerate(mesh.mesh_dim_names or ()) if "replicate" in name]
    if not dims or mesh.size(dims[0]) == 1:
        return None
    ranks = mesh.mesh.movedim(dims[0], 0).reshape(mesh.size(dims[0]), -1)
    return tuple(tuple(sorted(row.tolist())) for row in ranks)


def restricted(layout: MatrixLayout, ranks: Sequence[int]) -> MatrixLayout:
    """``layout`` on the ranks ``ranks`` of its group (one HSDP replica's), numbered in that order."""
    return MatrixLayout(layout.shape, tuple(layout.shards[rank] for rank in ranks))


def mesh_sizes(mesh: DeviceMesh) -> tuple[int, int]:
    """``(dp, tp)`` of a mesh: tp is the dimension named for tensor parallelism (a 2-D mesh without
    names: the second), dp every other dimension together."""
    names = mesh.mesh_dim_names
    if not names:
        return (mesh.size(0), mesh.size(1)) if mesh.ndim == 2 else (mesh.size(), 1)
    tp = math.prod(mesh.size(d) for d, name in enumerate(names) if "tp" in name or "tensor" in name)
    return mesh.size() // tp, tp


class MeshEngine:
    """Runs the optimizer step for all DTensor parameters that live on one device mesh.

    Args:
        rules: The rules of the optimizer's matrix groups (their matmul dtypes weigh FLOPs).
        settings: How to plan; ``None``: ``config.settings()``.
        batch_matrices: Update an owner's same-shape matrices of a micro-group in one call of their
            rule where it allows; ``False``: once per matrix (``canzona bench step``'s baseline).
        devices_per_node: Ranks per node, to price a plan's exchanges; ``None``: torchrun's
            ``LOCAL_WORLD_SIZE``, else one node.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        config: PlanConfig,
        rules: Sequence[MatrixRule],
        settings: PlanSettings | None = None,
        batch_matrices: bool = True,
        devices_per_node: int | None = None,
        owner: str = "optimizer",
    ) -> None:
        self.mesh, self.overlap, self.batch_matrices = mesh, config.overlap, batch_matrices
        self.group = mesh_process_group(mesh)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        dtypes = list(dict.fromkeys(rule.matmul_dtype() for rule in rules)) or [torch.float32]
        weights = flops_weights(config.team_prices, self.group, mesh.device_type, dtypes)
        if weights is None and self.rank == 0:  # every rank would say the same
            _warn_unweighted(owner, dtypes)
        #: What a FLOP of each matmul dtype costs in FLOPs of the first's (`prices.flops_weights`).
        self.flops_weights = weights or {}
        settings = config.settings() if settings is None else settings
        self.settings = priced(settings, config.team_prices, self.group, mesh.device_type, dtypes[0])
        if self.world < dist.get_world_size():
            # Every rank of the job creates every team's process group (dist.new_group): a mesh
            # on a slice of the job cannot ask the other ranks to, so its matrices stay whole.
            self.settings = replace(self.settings, max_team=1)
        #: The matrices as planned (``None`` before the first step or `prepare`).
        self.planned: PlannedMatrices | None = None
        self._key: tuple | None = None
        #: Each micro-group's all-to-alls, the dtype each travels in, and the step's arena.
        self.layout = StepLayout((), (), self.overlap)
        #: The next step's arena, once reserved (`reserve`).
        self.arena: Tensor | None = None
        self.owner = owner
        self.budget = config.memory_budget
        #: Costs of the latest step on this rank.
        self.stats = StepStats()
        #: The first exception of this rank's own work in the latest step (`StepRun.attempt`).
        self.failure: Exception | None = None
        self.clock = Clock(torch.device(mesh.device_type))
        self.meter = BufferMeter()
        #: The process group of every team that a plan had, by its ranks in member order.
        self.team_groups: dict[tuple[int, ...], TeamGroup] = {}
        self._groups: dict[frozenset[int], dist.ProcessGroup] = {}  # every team's, every copy's
        #: Each HSDP replica's global ranks (``None``: the mesh has no replicas).
        self.replicas = replica_ranks(mesh)
        self.replication_setting, self.devices_per_node = config.replicas, devices_per_node
        #: How the plan uses the replicas (``None`` before the first plan, or without replicas).
        self.replication: ReplicationChoice | None = None
        self._replica_groups: dist.ProcessGroup | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan (``None`` before the first step or `prepare`)."""
        return None if self.planned is None else self.planned.plan

    @property
    def device(self) -> torch.device:
        """The device of the matrices' shards, where the step's buffers live."""
        if self.planned is None or not self.planned.entries:
            return torch.device("cpu")
        return self.planned.entries[0].param.device

    @property
    def entries(self) -> list[Entry]:
        """The matrix entries planned (empty before the first plan)."""
        return [] if self.planned is None else self.planned.entries

    def custody(self, state: dict[Tensor, State]) -> MatrixStateCustody:
        """The custody of the matrix state in ``state`` under the current plan."""
        assert self.planned is not None, "no plan yet"
        return MatrixStateCustody(self.planned, [entry.rule for entry in self.planned.entries], state)

    def step(self, entries: Sequence[Entry], has_grad: Sequence[bool], state: dict[Tensor, State]) -> None:
        """One optimizer step of ``entries`` (all on this mesh); ``has_grad`` says, per entry, whether
        it has a gradient on every rank. An exception of this rank's own work lands in `failure`."""
        self.meter.restart()
        start = self.clock.mark()
        matrices = [entry for entry in entries if entry.rule is not None]
        self._ensure_plan(matrices, state)
        assert self.planned is not None
        rules = [entry.rule for entry in matrices]
        run = StepRun(
            self.planned,
            rules,
            state,
            self.team_groups,
            self.batch_matrices,
            self.clock,
            self.meter,
            self.memory_advice,
        )
        adamw: dict[int, list[Entry]] = {}  # by param group: one foreach step each
        for entry, stepped in zip(entries, has_grad):
            if entry.rule is None and stepped:
                adamw.setdefault(id(entry.group), []).append(entry)
        for group in adamw.values():
            params, names = [entry.param for entry in group], [entry.name for entry in group]
            run.attempt(functools.partial(step_adamw, params, names, state, group[0].group))
        stepped = [flag for entry, flag in zip(entries, has_grad) if entry.rule is not None]
        if self.arena is None:  # not reserved before the step's agreement (a new plan): agreed on now
            raise_if_failed_anywhere(self.reserve(), self.device, f"{self.owner}.step", self.group)
        assert self.arena is not None
        arena, self.arena = self.arena, None  # the step's own: freed with it
        run.matrices(stepped, self.layout, self.meter.track(arena))
        run.stats.step.add(start, self.clock.mark())
        run.stats.peak_buffer_bytes = self.meter.peak
        self.stats, self.failure = run.stats, run.failure

    def reserve(self) -> Exception | None:
        """Allocate the next step's arena, which holds every buffer its exchanges need, so that no
        rank fails an allocation between the step's collectives; the out-of-memory error, if any."""
        if self.planned is None or self.arena is not None:
            return None
        try:
            self.arena = torch.empty(self.layout.arena_bytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as error:
            return torch.OutOfMemoryError(f"{error} {self.memory_advice()}")
        return None

    def memory_advice(self) -> str:
        """What an out-of-memory error of the step says: the buffers' bytes and the setting to lower."""
        largest = max(
            (sum(getattr(b, n) for n in GroupBuffers.ARENA) for b in self.layout.buffers), default=0
        )
        return (
            f"The step's buffers take {size_text(self.layout.arena_bytes)} on this rank (its largest "
            f"micro-group {size_text(largest)}) with PlanConfig(memory_budget={self.budget!r}): lower "
            "memory_budget (a fraction of the rank's matrix bytes such as 0.25, or a size such as '1GiB') "
            "for smaller micro-groups, or free memory before the step (docs/memory.md)."
        )

    def prepare(self, entries: Sequence[Entry], state: dict[Tensor, State]) -> Plan:
        """Build the plan if the matrices changed (collective then), and return it."""
        self._ensure_plan([entry for entry in entries if entry.rule is not None], state)
        assert self.planned is not None
        return self.planned.plan

    def owned_state(self, state: dict[Tensor, State]) -> list[tuple[Tensor, State]]:
        """``(param, matrix state)`` of every matrix this rank owns (empty under ``sync``)."""
        if self.planned is None:
            return []
        return [
            (self.entries[index].param, matrix_state)
            for index, matrix_state in self.custody(state).owned().items()
        ]

    def splits_matrix_state(self, state: dict[Tensor, State]) -> bool:
        """Whether the plan has teams whose members hold slices of a matrix's state."""
        return self.planned is not None and bool(self.custody(state).stateful_team_items())

    def gather_team_state(self, state: dict[Tensor, State]) -> None:
        """Put every team's matrix state whole on its first member, as checkpoints hold it (collective)."""
        if self.planned is not None:
            self.custody(state).gather_team_state()

    def scatter_team_state(self, state: dict[Tensor, State]) -> None:
        """Give every team's members their slices of the state its first member holds (collective)."""
        if self.planned is not None:
            self.custody(state).scatter_team_state()

    def load_state(self, entries: Sequence[Entry], state: dict[Tensor, State]) -> None:
        """After a full checkpoint was loaded on every rank: re-plan, hand out and trim matrix state."""
        if self.planned is None:
            return
        self.prepare(entries, state)
        custody = self.custody(state)
        custody.scatter_team_state()
        custody.drop_foreign()
        custody.keep_loaded_stack_failures_on_one_owner()

    def _ensure_plan(self, matrices: list[Entry], state: dict[Tensor, State]) -> None:
        rules = [entry.rule for entry in matrices]
        key = tuple((id(entry.param), tuple(entry.param.shape), entry.rule) for entry in matrices)
        if key == self._key:
            # Same matrices, but the param groups may be new dicts (load_state_dict replaces
            # them): hyperparameters such as a scheduled lr must be read from the current ones.
            assert self.planned is not None
            self.planned.entries = matrices
            return
        previous = None if self.planned is None else self.custody(state).teams()
        layouts = exchange_layouts(
            [e.name for e in matrices], [e.param for e in matrices], self.mesh, self.group
        )
        plan, items, copies = self._plan(matrices, rules, layouts)
        advice = over_budget(plan) if self.rank == 0 else None  # every rank would say the same
        if advice is not None:
            warnings.warn(f"{self.owner}: {advice}", UserWarning, stacklevel=4)
        me = dist.get_rank()
        replica = next(index for index, ranks in enumerate(copies) if me in ranks)
        group = self.group if len(copies) == 1 else self._replica_group(copies)
        rank = copies[replica].index(me)
        self.planned = PlannedMatrices(plan, matrices, items, group, rank, replica)
        self._key = key
        item_layouts = [item.layout for item in items]
        # Each group travels in one dtype, wide enough for every member's rule.
        dtypes = [
            functools.reduce(
                torch.promote_types,
                (rules[items[m].entry].exchange_dtype(matrices[items[m].entry].param.dtype) for m in members),
            )
            for members in plan.micro_groups
        ]
        keys = [self._batch_key(plan, rules[item.entry], item, index) for index, item in enumerate(items)]
        exchanges = tuple(
            MicroGroupExchange(members, item_layouts, plan.teams, rank, plan.num_ranks, keys)
            for members in plan.micro_groups
        )
        self.layout = StepLayout(exchanges, tuple(dtypes), self.overlap)
        self.arena = None  # reserved for another plan
        self._create_team_groups(copies)
        self.custody(state).move(previous)

    def _batch_key(self, plan: Plan, rule: MatrixRule, item: Item, index: int) -> Hashable:
        """What item ``index`` shares with the items one call of its rule computes together: its team,
        rule and shape where the rule batches, else itself alone."""
        if self.batch_matrices and rule.batches_matrices:
            return (None if plan.teams is None else plan.teams[index], rule, item.layout.shape)
        return index

    def _plan(
        self, matrices: list[Entry], rules: list[MatrixRule], layouts: list[MatrixLayout]
    ) -> tuple[Plan, list[Item], tuple[tuple[int, ...], ...]]:
        """The plan of this rank's copy of the matrices, its items, and each copy's global ranks: one
        copy over the mesh, or one per HSDP replica under a replicated plan."""
        dp, tp = mesh_sizes(self.mesh)
        whole = (tuple(dist.get_global_rank(self.group, rank) for rank in range(self.world)),)
        if self.replicas is None or self.settings.policy == "sync":
            plan, items = self._plan_items(matrices, rules, layouts, self.rank, dp, tp, self.settings)
            return plan, items, whole
        # The first plan's choice stays: matrix state and team groups follow it.
        setting = self.replication.mode if self.replication is not None else self.replication_setting
        count = len(self.replicas)
        replicated = spread = spread_items = None
        if setting != "spread":
            first = [restricted(layout, self.replicas[0]) for layout in layouts]
            settings = self._priced_for(self.replicas[0])
            replicated, _ = self._plan_items(matrices, rules, first, 0, dp // count, tp, settings)
        if setting != "replicated":
            settings = self._priced_for(whole[0])
            spread, spread_items = self._plan_items(matrices, rules, layouts, self.rank, dp, tp, settings)
        self.replication = choose_replication(setting, count, replicated, spread)
        if self.replication.mode == "spread":
            assert spread is not None and spread_items is not None
            return spread, spread_items, whole
        assert replicated is not None
        # Every replica's plan is the first one's: its ranks hold its matrices as the first
        # replica's hold them (HSDP replicates the same shards).
        mine = next(ranks for ranks in self.replicas if dist.get_rank() in ranks)
        own_layouts = [restricted(layout, mine) for layout in layouts]
        items = build_items(matrices, own_layouts, mine.index(dist.get_rank()))
        return replicated, items, self.replicas

    def _plan_items(
        self,
        matrices: list[Entry],
        rules: list[MatrixRule],
        layouts: list[MatrixLayout],
        rank: int,
        dp: int,
        tp: int,
        settings: PlanSettings,
    ) -> tuple[Plan, list[Item]]:
        """The plan of ``matrices`` laid out as ``layouts`` on ``dp × tp``, and their items from ``rank``."""
        items = build_items(matrices, layouts, rank)
        specs = [
            matrix_spec(
                matrices[item.entry].name + ("" if item.member is None else f"[{item.member}]"),
                item.layout.shape,
                rules[item.entry],
                block_of(matrices[item.entry].name),
                holders(item.layout),
                matrices[item.entry].param.dtype,
            ).weighted(self.flops_weights.get(rules[item.entry].matmul_dtype(), 1.0))
            for item in items
        ]
        return self._local_team_members(build_plan(specs, dp, tp, settings), items), items

    def _priced_for(self, ranks: Sequence[int]) -> PlanSettings:
        """The settings for a plan over the global ``ranks``, priced by whether they span nodes."""
        per_node = self.devices_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        return priced_for(self.settings, len({rank // per_node for rank in ranks}) > 1)

    def _replica_group(self, replicas: tuple[tuple[int, ...], ...]) -> dist.ProcessGroup:
        """This rank's replica's process group (collective, once: every rank creates every replica's)."""
        if self._replica_groups is None:
            self._replica_groups = dist.new_subgroups_by_enumeration([list(ranks) for ranks in replicas])[0]
        return self._replica_groups

    def _local_team_members(self, plan: Plan, items: Sequence[Item]) -> Plan:
        """``plan`` with each team's members on the ranks that hold their slices, where they can trade."""
        if plan.teams is None:
            return plan
        teams = []
        for index, team in enumerate(plan.teams):
            if len(team) > 1:
                layout = items[index].layout
                slices = [Block(*block) for block in member_blocks(layout.shape, len(team))]
                held = [[layout.held_numel(rank, block) for rank in team] for block in slices]
                loads = list(zip(plan.loads[index], plan.steady[index], plan.peaks[index]))
                team = local_members(team, loads, held)
            teams.append(team)
        if tuple(teams) == plan.teams:
            return plan
        return replace(plan, teams=tuple(teams), owners=tuple(team[0] for team in teams))

    def _create_team_groups(self, copies: Sequence[Sequence[int]]) -> None:
        """A process group for each team of the plan in each of ``copies`` (collective: every rank creates
        every group, in the same order; kept across plans)."""
        assert self.planned is not None
        me = dist.get_rank()
        for team in sorted({team for team in self.planned.plan.teams or () if len(team) > 1}):
            for ranks in copies:
                members = [ranks[rank] for rank in team]
                key = frozenset(members)
                if key not in self._groups:
                    self._groups[key] = dist.new_group(sorted(members))
                if me in members:
                    # A new group numbers its ranks in the order of their global ranks.
                    ranks_in_group = tuple(sorted(members).index(rank) for rank in members)
                    self.team_groups[team] = TeamGroup(self._groups[key], ranks_in_group)


def _warn_unweighted(owner: str, dtypes: Sequence[torch.dtype]) -> None:
    names = [str(dtype).removeprefix("torch.") for dtype in dtypes]
    warnings.warn(
        f"The param groups of this {owner} multiply in {', '.join(names)}, and team_prices are given "
        "as figures: the plan balances their FLOPs as if equally fast and prices teams' collectives "
        f"in FLOPs of {names[0]} (the first group's). Use team_prices='h100' or 'measure', or the same "
        "compute_dtype in every param group, for a balanced plan.",
        UserWarning,
        stacklevel=4,
    )
