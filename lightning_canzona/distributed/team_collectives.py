"""Teams at work: the members of every team advance their computations in lockstep.

`run_teams` drives this rank's team computations of a micro-group round by round, every team's
packed collectives in flight together; a computation that fails on this rank restarts on zeros,
so that the rank keeps joining its teams' collectives. `member_state` and `joined_state` cut a
matrix's state into members' slices and join it again (docs/architecture.md#teams).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_canzona.distributed.agreement import InFlight, Reduction
from lightning_canzona.geometry import long_dim, member_blocks
from lightning_canzona.rules.base import (
    FAILURES,
    State,
    TeamComputation,
    TeamRequest,
    TeamRows,
    TeamSum,
    summed_dtype,
)

Round = tuple[TeamRequest, ...]


def _all_gather(*args: object, **kwargs: object) -> dist.Work | None:
    """``all_gather_into_tensor``, by the name torch 2.13 gave it (same signature; the old one warns)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(*args, **kwargs)


@dataclass(frozen=True)
class TeamGroup:
    """A team's process group and each member's rank in it, in member order (a plan may list a
    team's ranks out of rank order: `planning.micro_groups.balanced_groups`)."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]


@dataclass
class TeamRun:
    """One computation of this rank within a team: ``start(input, state)`` makes its generator.
    ``counters`` keeps the state's step counts as it started (they decide its rounds, so a restart on
    zeros begins from them); ``on_zeros`` marks a run that failed on this rank."""

    team: tuple[int, ...]
    start: Callable[[Tensor, State], TeamComputation]
    input: Tensor
    state: State = field(default_factory=dict)
    counters: State = field(default_factory=dict, repr=False)
    computation: TeamComputation | None = field(default=None, repr=False)
    answered: int = 0
    on_zeros: bool = False


def run_teams(
    runs: Sequence[TeamRun],
    groups: dict[tuple[int, ...], TeamGroup],
    attempt: Callable[[Callable[[], object]], object],
    failed: Callable[[], bool],
) -> tuple[list[Tensor], int]:
    """Drive ``runs`` (in the same order on every member of each team) to their results; return them
    and how many collectives this rank took part in. ``attempt`` runs a callable or keeps its
    exception as this rank's failure (`StepRun.attempt`); ``failed`` says whether this rank failed."""
    rounds: list[Round | None] = [None] * len(runs)
    results: list[Tensor | None] = [None] * len(runs)

    def advance(i: int, reply: tuple[Tensor, ...] | None) -> None:
        outcome = _advance(runs[i], reply, attempt, failed)
        if isinstance(outcome, Tensor):  # a computation may need no round at all
            results[i], rounds[i] = outcome, None
        else:
            rounds[i] = outcome

    for i in range(len(runs)):
        advance(i, None)
    collectives = 0
    while any(round_ is not None for round_ in rounds):
        live = [i for i, round_ in enumerate(rounds) if round_ is not None]
        pending = _launch([(runs[i].team, rounds[i]) for i in live], groups)  # type: ignore[misc]
        collectives += len(pending)
        replies = _finish(pending, [rounds[i] for i in live])  # type: ignore[misc]
        for i, reply in zip(live, replies):
            advance(i, reply)
    return results, collectives  # type: ignore[return-value]


def _advance(
    run: TeamRun,
    reply: tuple[Tensor, ...] | None,
    attempt: Callable[[Callable[[], object]], object],
    failed: Callable[[], bool],
) -> Round | Tensor:
    """Hand ``reply`` to the run (``None``: start it); its next round, or its result."""
    if not run.on_zeros and not failed():
        outcome = attempt(lambda: _send(run, reply))
        if outcome is not None:
            run.answered += reply is not None
            return outcome  # type: ignore[return-value]
    if not run.on_zeros:
        # Fast-forward the same computation on zeros to where the run failed: replies of the
        # right shapes are all it needs (their values no longer matter).
        tensors = {key: value.clone() for key, value in run.state.items() if isinstance(value, Tensor)}
        scratch = {**tensors, **run.counters}
        run.on_zeros, run.computation = True, run.start(torch.zeros_like(run.input), scratch)
        round_ = next(run.computation)
        for _ in range(run.answered):
            round_ = run.computation.send(tuple(_placeholder(request) for request in round_))
        if reply is None:
            return round_
    return _send(run, reply)


def _send(run: TeamRun, reply: tuple[Tensor, ...] | None) -> Round | Tensor:
    try:
        if run.computation is None:
            run.counters = {key: value for key, value in run.state.items() if not isinstance(value, Tensor)}
            run.computation = run.start(run.input, run.state)
            return next(run.computation)
        return run.computation.send(reply)  # type: ignore[arg-type]
    except StopIteration as done:
        return done.value


def _placeholder(request: TeamRequest) -> Tensor:
    """A reply of the shape that ``request``'s combination has."""
    if isinstance(request, TeamSum):
        return request.tensor
    shape = list(request.tensor.shape)
    shape[-2] = sum(request.sizes)
    return request.tensor.new_zeros(shape)


def _launch(
    rounds: Sequence[tuple[tuple[int, ...], Round]], groups: dict[tuple[int, ...], TeamGroup]
) -> list[tuple]:
    """Launch the packed collectives that combine every round over its team: one per team, kind and
    dtype (sums in `summed_dtype`), in the order that every member shares."""
    packs: dict[tuple, list[tuple[int, int]]] = {}
    for i, (team, round_) in enumerate(rounds):
        for j, request in enumerate(round_):
            dtype = request.tensor.dtype
            if isinstance(request, TeamSum):
                dtype = summed_dtype(dtype)
            packs.setdefault((team, type(request), dtype), []).append((i, j))
    pending = []
    for (team, kind, dtype), where in packs.items():
        requests, group = [rounds[i][1][j] for i, j in where], groups[team]
        if kind is TeamSum:
            buffer = torch.cat([request.tensor.reshape(-1).to(dtype) for request in requests])
            work = Reduction(buffer, dist.ReduceOp.SUM, group.group)
            shapes = None
        else:
            padded = [_padded_rows(request) for request in requests]
            local = torch.cat([tensor.reshape(-1) for tensor in padded])
            buffer = local.new_empty(len(team) * local.numel())
            work = InFlight(_all_gather, buffer, local, group=group.group)
            shapes = [tensor.shape for tensor in padded]  # each member's block, to unpack
        pending.append((kind, group.ranks, where, requests, shapes, buffer, work))
    return pending


def _finish(pending: list[tuple], rounds: Sequence[Round]) -> list[tuple[Tensor, ...]]:
    """Wait for `_launch`'s collectives; each round's combinations."""
    replies: list[list[Tensor | None]] = [[None] * len(round_) for round_ in rounds]
    for kind, ranks, where, requests, shapes, buffer, work in pending:
        work.wait()
        if kind is TeamSum:
            chunks = buffer.split([request.tensor.numel() for request in requests])
            combined = [chunk.view_as(r.tensor).to(r.tensor.dtype) for chunk, r in zip(chunks, requests)]
        else:
            size = len(ranks)
            gathered = buffer.view(size, -1)  # in the group's rank order
            if ranks != tuple(range(size)):
                gathered = gathered[list(ranks)]  # in member order
            members = gathered.split([shape.numel() for shape in shapes], dim=1)
            combined = [
                torch.cat(
                    [block[..., :rows, :] for block, rows in zip(part.reshape(size, *shape), request.sizes)],
                    dim=-2,
                )
                for part, shape, request in zip(members, shapes, requests)
            ]
        for (i, j), value in zip(where, combined):
            replies[i][j] = value
    return [tuple(reply) for reply in replies]  # type: ignore[arg-type]


def _padded_rows(request: TeamRows) -> Tensor:
    """The member's rows, padded to the largest member's, so that every member sends as much."""
    tensor = request.tensor
    missing = max(request.sizes) - tensor.size(-2)
    if not missing:
        return tensor
    pad = tensor.new_zeros(*tensor.shape[:-2], missing, tensor.size(-1))
    return torch.cat([tensor, pad], dim=-2)


def member_state(
    whole: State, sliced: Collection[str], shape: Sequence[int], member: int, size: int
) -> State:
    """Member ``member``'s matrix state in a team of ``size``: its slice (a copy) of the ``sliced``
    tensors, the others whole; a failure count on member 0 only."""
    offset, block = member_blocks(shape, size)[member]
    dim = long_dim(shape)
    part = {
        key: value.narrow(dim, offset[dim], block[dim]).clone() if key in sliced else value
        for key, value in whole.items()
    }
    if member > 0 and FAILURES in part:
        part[FAILURES] = 0
    return part


def joined_state(parts: Sequence[State], sliced: Collection[str], shape: Sequence[int]) -> State:
    """The whole matrix state from every member's, in member order: the ``sliced`` tensors joined, the
    failure counts added up, the rest member 0's."""
    dim = long_dim(shape)
    whole = {
        key: torch.cat([part[key].to(value.device) for part in parts], dim=dim) if key in sliced else value
        for key, value in parts[0].items()
    }
    if FAILURES in whole:
        whole[FAILURES] = sum(part.get(FAILURES, 0) for part in parts)
    return whole
