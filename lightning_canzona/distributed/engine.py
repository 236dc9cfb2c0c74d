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

Elementwise state (momentum, Adam moments) is a DTensor sharded like its parameter. Matrix state
(Shampoo/SOAP factors and bases, step counters) lives on the owner, in full, and nowhere else.
The plan is built once and rebuilt only when the parameter set changes; matrix state whose owner
changes then moves to the new owner.

An exception in this rank's own work (an update rule, out of memory) must not leave the other
ranks waiting in a collective: it is kept in `MeshEngine.failure`, this rank joins the rest of
the step's collectives with zeros, and the caller raises it on every rank once the step's
collectives are done (`lightning_canzona.distributed.failures`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_canzona.distributed import pipeline
from lightning_canzona.distributed.clock import Clock, Intervals
from lightning_canzona.distributed.exchange import MicroGroupExchange
from lightning_canzona.distributed.layout import MatrixLayout, exchange_layouts, local_tensor
from lightning_canzona.distributed.memory import BufferMeter
from lightning_canzona.distributed.updates import apply_matrix, prepare_matrix, step_adamw
from lightning_canzona.planning import MatrixSpec, Plan, PlanSettings, block_of, build_plan
from lightning_canzona.rules.adamw import ALGORITHM as ADAMW
from lightning_canzona.rules.base import MatrixRule
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
    """

    step: Intervals = field(default_factory=Intervals)
    compute: Intervals = field(default_factory=Intervals)
    wait: Intervals = field(default_factory=Intervals)
    matrices_computed: int = 0
    decomposition_failures: int = 0
    bytes_sent: int = 0
    all_to_alls: int = 0
    peak_buffer_bytes: int = 0

    def add(self, other: StepStats) -> None:
        """Count ``other`` (another mesh's step) in these."""
        for mine, theirs in ((self.step, other.step), (self.compute, other.compute), (self.wait, other.wait)):
            mine.extend(theirs)
        self.matrices_computed += other.matrices_computed
        self.decomposition_failures += other.decomposition_failures
        self.bytes_sent += other.bytes_sent
        self.all_to_alls += other.all_to_alls
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
    """

    def __init__(self, mesh: DeviceMesh, settings: PlanSettings, overlap: bool) -> None:
        self.mesh, self.settings, self.overlap = mesh, settings, overlap
        self.group = mesh_process_group(mesh)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.plan: Plan | None = None
        self._key: tuple | None = None
        self._entries: list[Entry] = []
        self._layouts: list[MatrixLayout] = []
        self._exchanges: list[MicroGroupExchange] = []
        self._exchange_dtypes: list[torch.dtype] = []
        #: Costs of the latest step on this rank.
        self.stats = StepStats()
        #: The first exception of this rank's work in the latest step (see the module docstring).
        self.failure: Exception | None = None
        self.clock = Clock(torch.device(mesh.device_type))
        self.meter = BufferMeter()

    def owner(self, index: int) -> int | None:
        """Owner group-rank of matrix ``index`` (``None`` under ``sync``)."""
        assert self.plan is not None
        return None if self.plan.owners is None else self.plan.owners[index]

    def computes(self, index: int) -> bool:
        owner = self.owner(index)
        return owner is None or owner == self.rank

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
        rules = [rule_of(entry.group) for entry in matrices]
        self._ensure_plan(matrices, rules, state)
        for entry, stepped in zip(entries, has_grad):
            if entry.algorithm == ADAMW and stepped:
                self.attempt(functools.partial(step_adamw, entry.param, state, entry.group))
        stepped = [flag for entry, flag in zip(entries, has_grad) if entry.algorithm != ADAMW]
        prepare = functools.partial(self._prepare_matrix, rules=rules, state=state, stepped=stepped)
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
        self._ensure_plan(matrices, [rule_of(entry.group) for entry in matrices], state)
        assert self.plan is not None
        return self.plan

    def _ensure_plan(
        self, matrices: list[Entry], rules: list[MatrixRule], state: dict[Tensor, State]
    ) -> None:
        specs = [
            MatrixSpec(
                entry.name, tuple(entry.param.shape), block_of(entry.name), rule.cost(entry.param.shape)
            )
            for entry, rule in zip(matrices, rules)
        ]
        key = tuple((id(entry.param), spec) for entry, spec in zip(matrices, specs))
        if key == self._key:
            # Same matrices, but the param groups may be new dicts (load_state_dict replaces
            # them): hyperparameters such as a scheduled lr must be read from the current ones.
            self._entries = matrices
            return
        previous_owners = (
            {id(e.param): self.owner(i) for i, e in enumerate(self._entries)} if self.plan else {}
        )
        self._layouts = exchange_layouts([e.name for e in matrices], [e.param for e in matrices], self.group)
        self.plan = build_plan(specs, *mesh_sizes(self.mesh), self.settings)
        self._entries, self._key = matrices, key
        self._exchanges = [
            MicroGroupExchange(members, self._layouts, self.plan.owners, self.rank, self.world)
            for members in self.plan.micro_groups
        ]
        # Each group travels in one dtype, wide enough for every member's rule.
        self._exchange_dtypes = [
            functools.reduce(
                torch.promote_types, (rules[m].exchange_dtype(matrices[m].param.dtype) for m in members)
            )
            for members in self.plan.micro_groups
        ]
        self._move_matrix_state(previous_owners, rules, state)

    def _move_matrix_state(
        self, previous_owners: dict[int, int | None], rules: list[MatrixRule], state: dict[Tensor, State]
    ) -> None:
        """Hand matrix state to a matrix's new owner when a rebuilt plan moved it."""
        for index, entry in enumerate(self._entries):
            old = previous_owners.get(id(entry.param), self.owner(index))
            new = self.owner(index)
            if old == new:
                continue
            held = state.get(entry.param, {})
            matrix_state = rules[index].matrix_state(held)
            for key in matrix_state:
                del held[key]
            payload = [matrix_state if old in (None, self.rank) else None]
            source = 0 if old is None else old
            dist.broadcast_object_list(
                payload, src=dist.get_global_rank(self.group, source), group=self.group
            )
            if new is None or new == self.rank:
                state.setdefault(entry.param, {}).update(
                    {k: v.to(entry.param.device) for k, v in (payload[0] or {}).items()}
                )
        self.drop_foreign_matrix_state(state, rules)

    def drop_foreign_matrix_state(self, state: dict[Tensor, State], rules: Sequence[MatrixRule]) -> None:
        """Remove matrix state from ranks that do not own the matrix (a full, single-file
        checkpoint loads every owner's state on every rank)."""
        for index, entry in enumerate(self._entries):
            if not self.computes(index) and entry.param in state:
                for key in rules[index].matrix_state(state[entry.param]):
                    del state[entry.param][key]

    def owned_matrix_state(self, state: dict[Tensor, State], rules: Sequence[MatrixRule]) -> dict[int, State]:
        """This rank's matrix state, by index of the matrix in the plan."""
        if self.plan is None or self.plan.owners is None:
            return {}
        return {
            index: rules[index].matrix_state(state.get(entry.param, {}))
            for index, entry in enumerate(self._entries)
            if self.owner(index) == self.rank
        }

    def _prepare_matrix(
        self, index: int, rules: Sequence[MatrixRule], state: dict[Tensor, State], stepped: Sequence[bool]
    ) -> Tensor:
        """Matrix ``index``'s elementwise part on this rank's shard: what its gather sends."""
        param = self._entries[index].param
        zeros = functools.partial(torch.zeros_like, local_tensor(param))
        if not stepped[index]:  # joins the collectives with zeros; nobody computes or applies it
            return self.meter.track(zeros())
        work = functools.partial(prepare_matrix, param, rules[index], state, self.computes(index))
        prepared = self.attempt(work, zeros)
        # A rule may hand back its input or its state (Shampoo the gradient, Muon its momentum):
        # only a new tensor is memory of the step's own.
        held = [param.grad, *state.get(param, {}).values()]
        if all(local_tensor(t).data_ptr() != prepared.data_ptr() for t in held if t is not None):
            self.meter.track(prepared)
        return prepared


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
        prepare: Callable[[int], Tensor],
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
        prepared = {m: self.prepare(m) for m in self.exchange.members}
        self.gathered, self.gather_work = self.exchange.launch_gather(
            prepared, self.dtype, self.device, self.engine.group, self.engine.meter
        )
        self._count(self.gathered.element_size(), self.exchange.gather_send_sizes)

    def compute(self) -> None:
        stats, clock = self.engine.stats, self.engine.clock
        start = clock.mark()
        self.gather_work.wait()
        computing = clock.mark()
        stats.wait.add(start, computing)
        full = self.exchange.assemble(self.gathered, self.engine.meter)
        del self.gathered, self.gather_work  # the receive buffer, and the send buffer it holds
        for m in list(full):
            matrix = full.pop(m)
            zeros = functools.partial(torch.zeros_like, matrix)
            if self.stepped[m]:
                work = functools.partial(self._direction, m, matrix)
                self.directions[m] = self.engine.attempt(work, zeros)
            else:
                self.directions[m] = zeros()
            del matrix
        stats.compute.add(computing, clock.mark())

    def _direction(self, m: int, matrix: Tensor) -> Tensor:
        param_state = self.state[self.engine._entries[m].param]
        failures = int(param_state.get(FAILURES, 0))
        direction = self.rules[m].direction(matrix, param_state)
        stats = self.engine.stats
        stats.matrices_computed += 1
        stats.decomposition_failures += int(param_state.get(FAILURES, 0)) - failures
        return self.engine.meter.track(direction)

    def launch_scatter(self) -> None:
        if self.exchange.scatters:
            self.scattered, self.scatter_work = self.exchange.launch_scatter(
                self.directions, self.dtype, self.device, self.engine.group, self.engine.meter
            )
            self._count(self.scattered.element_size(), self.exchange.scatter_send_sizes)
            self.directions = {}  # packed into the send buffer (under sync they are the updates)

    def finish(self) -> None:
        if self.scattered is not None:
            clock = self.engine.clock
            start = clock.mark()
            self.scatter_work.wait()
            self.engine.stats.wait.add(start, clock.mark())
        for m, update in self.exchange.my_updates(self.scattered, self.directions).items():
            if self.stepped[m]:
                entry = self.engine._entries[m]
                work = functools.partial(apply_matrix, entry.param, self.rules[m], update, entry.group)
                self.engine.attempt(work)
        self.directions, self.scattered, self.scatter_work = {}, None, None

    def _count(self, element_bytes: int, send_sizes: list[int]) -> None:
        self.engine.stats.all_to_alls += 1
        # What leaves this rank: its block for itself stays in memory.
        others = sum(send_sizes) - send_sizes[self.engine.rank]
        self.engine.stats.bytes_sent += element_bytes * others
