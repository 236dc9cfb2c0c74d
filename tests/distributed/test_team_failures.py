"""A failure in a team is the same error on every rank, in seconds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from free_teams import TeamMuon, with_free_teams
from multiprocess import DEVICE, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import lightning_canzona as lc
from lightning_canzona.rules.muon import MuonRule
from lightning_canzona.rules.shampoo import ShampooRule
from lightning_canzona.rules.soap import SOAPRule

FAILING_TEAMS = {
    "muon": (MuonRule, lambda params: TeamMuon(params, lr=0.02, compute_dtype="float32")),
    "soap": (
        SOAPRule,
        lambda params: with_free_teams(lc.SOAP)(
            params, lr=0.01, precondition_frequency=2, max_precond_dim=64
        ),
    ),
    "shampoo": (
        ShampooRule,
        lambda params: with_free_teams(lc.Shampoo)(
            params, lr=0.01, precondition_frequency=2, start_preconditioning_step=2
        ),
    ),
}


def _a_member_fails(rank: int, world_size: int, optimizer_name: str) -> None:
    rule_class, build = FAILING_TEAMS[optimizer_name]
    mesh = init_device_mesh(DEVICE, (world_size,))
    torch.manual_seed(0)
    full = torch.randn(12, 200, device=DEVICE)
    weight = nn.Parameter(distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None))
    optimizer = build([("weight", weight)])
    grad = torch.randn(12, 200, device=DEVICE)
    weight.grad = distribute_tensor(grad, mesh, [Shard(1)], src_data_rank=None)
    optimizer.step()
    (engine,) = optimizer.engines.values()
    assert engine.plan.teams == ((0, 1, 2, 3),)
    if optimizer_name != "muon":  # Muon's teams hold no matrix state
        _state_goes_whole_to_the_first_member_and_back(optimizer, weight, rank)
    original = rule_class.team_direction
    failures = []

    def fails_in_the_second_round(self, matrix, shape, member, size, state):
        steps = original(self, matrix, shape, member, size, state)
        reply = yield next(steps)
        if not failures:  # once: the rank then rejoins its team's rounds on zeros
            failures.append(member)
            raise torch.OutOfMemoryError("injected in a team")
        return (yield from _forward(steps, reply))

    rule_class.team_direction = fails_in_the_second_round if rank == world_size - 1 else original
    try:
        optimizer.step()  # the team finishes its rounds; the next step's one read raises
    finally:
        rule_class.team_direction = original
    with pytest.raises(
        RuntimeError, match=r"failed on rank 3: OutOfMemoryError\(.injected in a team The step's"
    ):
        optimizer.step()
    dist.barrier()  # every rank got here: nobody is left in a team's collective
    assert failures == ([3] if rank == 3 else [])
    optimizer.step()  # the next step runs normally
    assert engine.stats.team_collectives > 0


def _state_goes_whole_to_the_first_member_and_back(optimizer, weight, rank: int) -> None:
    """A checkpoint's hand-over of the team's state (SOAP's and Shampoo's slices): whole on its
    first member, then the same slices on every member again."""
    assert optimizer.splits_matrix_state()
    slices = {key: value.clone() for key, value in optimizer.state[weight].items() if torch.is_tensor(value)}
    with optimizer.whole_team_state():
        held = optimizer.state[weight]
        if rank == 0:
            assert set(slices) <= set(held)
            assert any(held[key].shape != value.shape for key, value in slices.items())  # whole
        else:
            assert not set(slices) <= set(held)  # handed over
    for key, value in slices.items():  # dtype, device and every bit
        torch.testing.assert_close(optimizer.state[weight][key], value, rtol=0.0, atol=0.0, msg=key)


def _forward(steps, reply):
    """Hand ``reply`` on to ``steps`` and relay the rest of its rounds; its result."""
    try:
        while True:
            reply = yield steps.send(reply)
    except StopIteration as done:
        return done.value


def _members_fail(rank: int, world_size: int) -> None:
    for optimizer_name in FAILING_TEAMS:
        _a_member_fails(rank, world_size, optimizer_name)


def test_a_failure_in_a_team_is_the_same_error_on_every_rank_in_seconds() -> None:
    # On an NCCL process group (emulated on CPU ranks): the teams' collectives and the hand-over
    # of their state send device tensors, and tensors in no object collective.
    run_on_ranks(4, _members_fail, timeout=30.0, nccl_like=True)
