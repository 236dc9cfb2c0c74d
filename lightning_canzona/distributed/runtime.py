"""One optimizer step of one mesh's matrices, as the plan lays it out.

Every matrix entry's elementwise part (`MatrixRule.prepare`) runs on its shards; then the
micro-groups run through the pipeline (`distributed.pipeline`): one packed all-to-all gathers the
shards to the owners, each owner computes the full updates of its matrices
(`MatrixRule.direction`), a team's members theirs together (`MatrixRule.team_direction`,
`distributed.team_collectives`), one packed all-to-all returns the update blocks, and every rank applies its
blocks (`MatrixRule.apply`).

An exception in this rank's own work (an update rule, out of memory) must not leave the other
ranks waiting in a collective: `StepRun.attempt` keeps it in `StepRun.failure`, this rank joins the
rest of the step's collectives with zeros, and the caller raises it on every rank once the step's
collectives are done (`lightning_canzona.distributed.failures`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_canzona.distributed import pipeline
from lightning_canzona.distributed.clock import Clock, Intervals
from lightning_canzona.distributed.exchange import MicroGroupExchange
from lightning_canzona.distributed.items import Item, PlannedMatrices
from lightning_canzona.distributed.layout import local_tensor
from lightning_canzona.distributed.memory import BufferMeter
from lightning_canzona.distributed.team_collectives import TeamGroup, TeamRun, run_teams
from lightning_canzona.distributed.updates import (
    apply_matrices,
    member_direction,
    member_prefix,
    prepare_matrices,
)
from lightning_canzona.rules.base import MatrixRule, State, as_matrix, state_part, store_state_part
from lightning_canzona.rules.kronecker import FAILURES, RETRIES


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
        decomposition_retries: Factor decompositions of this step that failed in float32 and
            were computed again in float64 (`lightning_canzona.rules.kronecker.decompose`).
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
    """What one step of one mesh's matrices shares: the plan, the rules and state, and what the
    step costs.

    Attributes:
        planned: The matrices as planned.
        rules: Each matrix entry's rule.
        state: The optimizer's state, by parameter.
        team_groups: The process group of every team of the plan.
        batch_matrices: Update an owner's same-shape matrices in one call where the rule allows.
        clock: Times the step on the device.
        meter: Counts the step's own buffers.
        stats: What the step cost this rank.
        failure: The first exception of this rank's own work in the step.
    """

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
        """Prepare, gather, compute, scatter and apply every micro-group of the plan.

        ``stepped`` tells, per matrix entry, whether it has a gradient; ``exchanges`` and
        ``dtypes`` are each micro-group's all-to-alls and the dtype they travel in.
        """
        stepped_items = [stepped[item.entry] for item in self.planned.items]
        prepare = PreparedEntries(self, stepped)
        steps = [
            MicroGroupStep(self, exchange, dtype, prepare, stepped_items)
            for exchange, dtype in zip(exchanges, dtypes)
        ]
        retries = RETRIES.count
        pipeline.run(steps, overlap)
        self.stats.decomposition_retries += RETRIES.count - retries


class PreparedEntries:
    """Each matrix entry's elementwise part on this rank's shard, run once per step, and each
    item's piece of it: what the item's gather sends. The entries of a micro-group that are not
    prepared yet are prepared together, one call of their rule per param group; an entry's
    result is dropped once its last item has taken its piece."""

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
            work = functools.partial(prepare_matrices, params, run.rules[batch[0]], run.state, holds)
            zeros = functools.partial(_zeros_like_each, [local_tensor(param) for param in params])
            for entry, param, prepared in zip(batch, params, run.attempt(work, zeros)):
                # A rule may hand back its input or its state (Shampoo the gradient, Muon its
                # momentum): only a new tensor is memory of the step's own.
                held = [param.grad, *run.state.get(param, {}).values()]
                if all(local_tensor(t).data_ptr() != prepared.data_ptr() for t in held if t is not None):
                    run.meter.track(prepared)
                self.prepared[entry] = prepared


def _team_start(rule: MatrixRule, shape: tuple[int, ...], member: int, size: int) -> Callable[..., Any]:
    """Starts ``rule``'s team computation of a matrix of ``shape`` on a member's slices and state."""
    return lambda matrix, state: rule.team_direction(matrix, shape, member, size, state)


def _zeros_like_each(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [torch.zeros_like(t) for t in tensors]


class MicroGroupStep:
    """One micro-group's gather, compute, scatter and apply (see `pipeline.GroupStep`).

    Each phase drops the buffers that later phases do not need, so that the step holds the
    buffers of the groups in flight only, not of every group until the step ends.
    """

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
        """The directions of one batch of matrices that this rank computes alone."""
        matrices = [full.pop(m) for m in members]
        zeros = functools.partial(_zeros_like_each, matrices)
        if self.stepped[members[0]]:
            work = functools.partial(self._direction, members, matrices)
            self.directions.update(zip(members, self.run.attempt(work, zeros)))
        else:
            self.directions.update(zip(members, zeros()))

    def _team_directions(self, slices: dict[int, Tensor]) -> None:
        """The slices of the updates that this rank computes in teams: per team, same-shape
        matrices of a rule without matrix state in one batched computation, all teams in
        lockstep (`distributed.team_collectives`)."""
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
        """This member's matrix state of team item ``m`` (created on first use), or ``{}`` for a
        batch of a rule without matrix state."""
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
        """The computed items, in batches that one call of their rule updates: matrices of the
        same shape and rule (`MatrixRule.batches_matrices`: stacked, they are a stack), else one."""
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
