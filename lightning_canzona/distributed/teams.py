"""Teams at work: the members of every team advance their computations in lockstep.

A team computes a matrix's update together (`lightning_canzona.planning.teams`): each member runs
the rule's generator on its slice (`MatrixRule.team_direction`), which yields what the team must
combine. Per round, every computation of this rank yields one request; the requests of one team
travel packed — one all-reduce for its sums, one all-gather for its rows, per dtype — and every
team's collectives are in flight together, so that teams on other ranks never wait for each
other. Every member of a team runs the same computations in the same order (the plan and the
micro-group fix them), so their packed buffers match.

A computation that fails on this rank (out of memory) is started again on zeros and fast-forwarded
to the same round: the rank keeps joining its teams' collectives, as every rank must, and the
failure is raised on every rank after the step (`lightning_canzona.distributed.failures`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_canzona.rules.base import TeamRequest, TeamRows, TeamSum

Computation = Generator[TeamRequest, Tensor, Tensor]


@dataclass
class TeamRun:
    """One computation of this rank within a team.

    Attributes:
        team: The team's ranks (group ranks of the engine's mesh).
        start: Starts the computation on an input (the member's slices).
        input: The member's slices.
    """

    team: tuple[int, ...]
    start: Callable[[Tensor], Computation]
    input: Tensor
    computation: Computation | None = field(default=None, repr=False)
    answered: int = 0
    on_zeros: bool = False


def run_teams(
    runs: Sequence[TeamRun],
    groups: dict[tuple[int, ...], dist.ProcessGroup],
    attempt: Callable[[Callable[[], object]], object],
    failed: Callable[[], bool],
) -> tuple[list[Tensor], int]:
    """Drive ``runs`` to their results.

    Args:
        runs: This rank's computations, in the same order on every member of each team.
        groups: The process group of each team.
        attempt: Runs a callable and returns its result, or keeps its exception as this rank's
            failure and returns ``None`` (`MeshEngine.attempt`).
        failed: Whether this rank has failed in this step.

    Returns:
        Each run's result, and how many collectives this rank took part in.
    """
    requests: list[TeamRequest | None] = []
    results: list[Tensor | None] = [None] * len(runs)
    for run in runs:
        requests.append(_advance(run, None, attempt, failed))
    collectives = 0
    while any(request is not None for request in requests):
        live = [i for i, request in enumerate(requests) if request is not None]
        replies, launched = _combine([runs[i].team for i in live], [requests[i] for i in live], groups)
        collectives += launched
        for i, reply in zip(live, replies):
            outcome = _advance(runs[i], reply, attempt, failed)
            if isinstance(outcome, Tensor):
                results[i], requests[i] = outcome, None
            else:
                requests[i] = outcome
    return results, collectives  # type: ignore[return-value]


def _advance(
    run: TeamRun,
    reply: Tensor | None,
    attempt: Callable[[Callable[[], object]], object],
    failed: Callable[[], bool],
) -> TeamRequest | Tensor:
    """Hand ``reply`` to the run (``None``: start it); its next request, or its result."""
    if not run.on_zeros and not failed():
        outcome = attempt(lambda: _send(run, reply))
        if outcome is not None:
            run.answered += reply is not None
            return outcome  # type: ignore[return-value]
    if not run.on_zeros:
        # Fast-forward the same computation on zeros to where the run failed: replies of the
        # right shapes are all it needs (their values no longer matter).
        run.on_zeros, run.computation = True, run.start(torch.zeros_like(run.input))
        request = next(run.computation)
        for _ in range(run.answered):
            request = run.computation.send(_placeholder(request))
        if reply is None:
            return request
    return _send(run, reply)


def _send(run: TeamRun, reply: Tensor | None) -> TeamRequest | Tensor:
    try:
        if run.computation is None:
            run.computation = run.start(run.input)
            return next(run.computation)
        return run.computation.send(reply)
    except StopIteration as done:
        return done.value


def _placeholder(request: TeamRequest) -> Tensor:
    """A reply of the shape that ``request``'s combination has."""
    if isinstance(request, TeamSum):
        return request.tensor
    shape = list(request.tensor.shape)
    shape[-2] = sum(request.sizes)
    return request.tensor.new_zeros(shape)


def _combine(
    teams: Sequence[tuple[int, ...]],
    requests: Sequence[TeamRequest],
    groups: dict[tuple[int, ...], dist.ProcessGroup],
) -> tuple[list[Tensor], int]:
    """Every request's combination over its team: launch all packed collectives, then wait."""
    packs: dict[tuple, list[int]] = {}
    for i, (team, request) in enumerate(zip(teams, requests)):
        packs.setdefault((team, type(request), request.tensor.dtype), []).append(i)
    pending = []
    for (team, kind, _), indices in packs.items():
        group = groups[team]
        if kind is TeamSum:
            buffer = torch.cat([requests[i].tensor.reshape(-1) for i in indices])
            pending.append((kind, indices, buffer, dist.all_reduce(buffer, group=group, async_op=True)))
        else:
            local = torch.cat([_padded_rows(requests[i]).reshape(-1) for i in indices])
            buffer = local.new_empty(len(team) * local.numel())
            work = dist.all_gather_into_tensor(buffer, local, group=group, async_op=True)
            pending.append((kind, indices, buffer.view(len(team), -1), work))
    replies: list[Tensor | None] = [None] * len(requests)
    for kind, indices, buffer, work in pending:
        work.wait()
        if kind is TeamSum:
            sizes = [requests[i].tensor.numel() for i in indices]
            for i, chunk in zip(indices, buffer.split(sizes)):
                replies[i] = chunk.view_as(requests[i].tensor)
        else:
            padded = [_padded_rows(requests[i]) for i in indices]  # shapes only
            offsets = [0]
            for tensor in padded:
                offsets.append(offsets[-1] + tensor.numel())
            for i, tensor, begin, end in zip(indices, padded, offsets, offsets[1:]):
                blocks = buffer[:, begin:end].reshape(len(teams[i]), *tensor.shape)
                sizes = requests[i].sizes  # type: ignore[union-attr]
                replies[i] = torch.cat([blocks[j][..., : sizes[j], :] for j in range(len(sizes))], dim=-2)
    return replies, len(pending)  # type: ignore[return-value]


def _padded_rows(request: TeamRows) -> Tensor:
    """The member's rows, padded to the largest member's, so that every member sends as much."""
    tensor = request.tensor
    missing = max(request.sizes) - tensor.size(-2)
    if not missing:
        return tensor
    pad = tensor.new_zeros(*tensor.shape[:-2], missing, tensor.size(-1))
    return torch.cat([tensor, pad], dim=-2)
