"""Teams compute a matrix's update exactly as one rank: Newton–Schulz and Kronecker rules on
slices in lockstep, and what their cost models count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_canzona.distributed.team_collectives import joined_state, member_state
from lightning_canzona.geometry import long_dim, member_blocks
from lightning_canzona.rules.base import TeamSum
from lightning_canzona.rules.muon import MuonRule
from lightning_canzona.rules.newton_schulz import (
    FORMS,
    PRESETS,
    newton_schulz,
    splits_polynomial,
    team_newton_schulz,
    team_work,
)
from lightning_canzona.rules.shampoo import ShampooRule
from lightning_canzona.rules.soap import SOAPRule


def _slices(full: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [
        full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        for offset, shape in member_blocks(full.shape, size)
    ]


def _in_lockstep(runs: list, shape) -> torch.Tensor:
    """Every member's team computation, rounds combined here, the members' results joined."""
    rounds: list = [None] * len(runs)
    results: list = [None] * len(runs)

    def advance(member: int, reply) -> None:
        try:
            rounds[member] = runs[member].send(reply)
        except StopIteration as done:
            results[member] = done.value

    for member in range(len(runs)):
        advance(member, None)
    while any(result is None for result in results):
        reply = tuple(
            sum(r.tensor for r in requests)
            if isinstance(requests[0], TeamSum)
            else torch.cat([r.tensor for r in requests], dim=-2)
            for requests in zip(*rounds)
        )
        for member in range(len(runs)):
            advance(member, reply)
    return torch.cat(results, dim=long_dim(shape))


def _newton_schulz_in_lockstep(full: torch.Tensor, size: int, form: str) -> torch.Tensor:
    args = (PRESETS["quintic"], 5, 1e-7, torch.float32)
    runs = [
        team_newton_schulz(part, full.shape, *args, member, size, form)
        for member, part in enumerate(_slices(full, size))
    ]
    return _in_lockstep(runs, full.shape)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(6, 50), (50, 6), (33, 33), (3, 7, 20)])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_team_newton_schulz_equals_one_rank(shape, size, form) -> None:
    # (33, 33) over 3 or 4 members splits the polynomial's rows; (6, 50) does not.
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(size))
    expected = newton_schulz(matrix, PRESETS["quintic"], 5, 1e-7, torch.float32, form)
    torch.testing.assert_close(_newton_schulz_in_lockstep(matrix, size, form), expected, rtol=1e-5, atol=1e-5)


KRONECKER_RULES = {
    "shampoo": ShampooRule(precondition_frequency=2, start_preconditioning_step=2, max_precond_dim=8),
    "soap": SOAPRule(precondition_frequency=2, max_precond_dim=8),
    "soap, bf16 state": SOAPRule(precondition_frequency=2, max_precond_dim=8, state_dtype="bfloat16"),
}


@pytest.mark.parametrize(
    ("rule_name", "shape"),
    [
        (name, shape)
        for name in sorted(KRONECKER_RULES)
        for shape in [(6, 50), (50, 6), (13, 10), (7, 5), (5, 8), (7, 7)]
    ],
)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_kronecker_team_updates_equal_one_rank(rule_name, shape, size) -> None:
    # (13, 10) has no factor at max_precond_dim 8: the members' computations are their own
    # (SOAP: no round at all; Shampoo: its grafting norms). (7, 5), (5, 8) and (7, 7) have factors
    # on both sides (the long side's in rows, the gradient and momentum gathered; SOAP's basis
    # whole on every member, its refresh reordering the members' rows of the second moment). Five
    # steps: decompositions at 1 (SOAP), 2 and 4, refreshes at 2 and 4 (SOAP).
    rule = KRONECKER_RULES[rule_name]
    assert rule.team_cost(shape, size) is not None
    whole = rule.init_matrix_state(torch.Size(shape), torch.device("cpu"))
    members = [rule.init_team_state(shape, m, size, torch.device("cpu")) for m in range(size)]
    generator = torch.Generator().manual_seed(size)
    for _ in range(5):
        # Small integers: the factor's sum over slices is exact in any order.
        grad = torch.randint(-3, 4, shape, generator=generator).float()
        expected = rule.direction(grad, whole)
        runs = [
            rule.team_direction(part, shape, m, size, members[m])
            for m, part in enumerate(_slices(grad, size))
        ]
        # Relative in norm: a wide matrix's team rotates its transposed slices (other ulps, which
        # SOAP's Adam ratio grows where a rotated entry is near zero: 2e-6 measured, 3e-8 tall).
        error = torch.linalg.vector_norm(_in_lockstep(runs, shape) - expected)
        assert error <= 1e-5 * torch.linalg.vector_norm(expected)
    # The members' state joined is the one-rank state.
    joined = joined_state(members, rule.team_sliced_keys(shape), shape)
    assert joined.keys() == whole.keys()
    for key, value in whole.items():
        torch.testing.assert_close(joined[key], value, rtol=1e-5, atol=1e-6, msg=key)
        member = member_state(joined, rule.team_sliced_keys(shape), shape, 1, size)[key]
        assert type(member) is type(members[1][key]), key  # counters are numbers, the rest tensors
        assert getattr(member, "shape", None) == getattr(members[1][key], "shape", None), key


def test_kronecker_team_costs_count_the_members_work_and_what_they_send() -> None:
    shampoo, soap = ShampooRule(max_precond_dim=64), SOAPRule(max_precond_dim=64, precondition_frequency=4)
    assert shampoo.team_cost((3, 130, 40), 2) is None  # a stack
    assert shampoo.team_cost((130, 40), 131) is None  # more members than rows
    cost = soap.team_cost((130, 40), 4)
    whole = soap.cost((130, 40))
    # A quarter of the rows (rounded up): 4 products of 2·40·33·40; the short side's whole
    # decomposition on the last member only.
    assert cost.flops == 4 * 2 * 40 * 33 * 40 + 10 * 33 * 40
    assert cost.member_flops == (0.0, 0.0, 0.0, 10 * 40**3 / 4)
    # On a step that decomposes, the last member pays the whole decomposition; on others, none.
    assert (cost.period, cost.periodic_flops) == (4, (0.0, 0.0, 0.0, 10 * 40**3))
    assert cost.step_flops_of(3, periodic=True) == cost.flops + 10 * 40**3
    assert cost.step_flops_of(3, periodic=False) == cost.step_flops_of(0, periodic=True) == cost.flops
    assert whole.step_flops_of(0, periodic=True) - whole.step_flops_of(0, periodic=False) == 10 * 40**3
    assert cost.busiest_flops < whole.flops and cost.numel == 33 * 40
    assert (cost.team_messages, soap.team_cost((130, 70), 4).team_messages) == (1, 0)
    assert shampoo.team_cost((130, 40), 4).team_messages == 2
    assert cost.matrix_state_bytes == 4 * (2 * 33 * 40 + 2 * 40 * 40)
    # The factor summed (a ring sends 2·3/4 of it), its basis shared every 4th step, two norms.
    assert cost.team_numel == round(1.5 * 40 * 40 + 1.5 * 40 * 40 / 4) + 2
    # Both sides, SOAP: the factor's rows, its basis whole; three matrices gathered per step.
    soap_two_sided = soap.team_cost((64, 48), 4)
    assert soap_two_sided.matrix_state_bytes == 4 * (2 * 16 * 48 + 2 * 48 * 48 + 16 * 64 + 64 * 64)
    assert (soap_two_sided.team_messages, soap.cost((64, 48)).flops > 2 * soap_two_sided.busiest_flops) == (
        3,
        True,
    )
    # Both sides (Shampoo): a member's 16 rows of 64 × 48; the long side's root on member 0,
    # the short side's on the last;
    # the gradient and momentum gathered whole (each member sends its 16 × 48 to 3 others), the
    # factor's and the root's rows before a decomposition (every 10th step).
    two_sided = shampoo.team_cost((64, 48), 4)
    assert two_sided.flops == 2 * 2 * (48 + 64) * 16 * 48 + 10 * 16 * 48
    assert two_sided.member_flops == (10 * 64**3 / 10, 0.0, 0.0, 10 * 48**3 / 10)
    assert shampoo.team_cost((64, 48), 2).member_flops == (10 * 64**3 / 10, 10 * 48**3 / 10)
    assert two_sided.matrix_state_bytes == 4 * (2 * 16 * 48 + 2 * 48 * 48 + 2 * 16 * 64)
    shared = 1.5 * (48 * 48 + 64 * 64) / 10
    assert two_sided.team_numel == round(shared + 1.5 * 48 * 48 + 3 * (2 * 16 * 48 + 2 * 16 * 64 / 10)) + 2
    assert two_sided.busiest_flops < shampoo.cost((64, 48)).flops / 2


def test_team_work_counts_what_the_team_computation_does() -> None:
    # Split polynomial (2·33·3 > 33): one gather per step besides the sums; FLOPs per member.
    work = team_work(33, 33, 5, "standard", 4)
    assert splits_polynomial(33, 33, 4) and work.collectives == 5 + 5
    assert work.flops == 5 * (4 * 33 * 33 * 9 + 2 * 33 * 33 * 9)
    # bf16 Gram matrices are summed in float32 on every backend, with the float32 norm: one
    # collective per round, two bf16 elements' worth of bytes per element.
    assert not splits_polynomial(64, 1024, 4)
    for form, collectives in (("standard", 5), ("gram", 2)):  # the Gram form: the first, one restart
        bf16, float32 = (team_work(64, 1024, 5, form, 4, dtype) for dtype in (torch.bfloat16, torch.float32))
        assert bf16.collectives == float32.collectives == collectives
        assert abs(bf16.numel - 2 * float32.numel) <= 1  # each rounded to a whole element
    # Beside a float64 Gram matrix the float32 norm travels apart: one collective more.
    assert team_work(64, 1024, 5, "standard", 4, torch.float64).collectives == 6
    rule = MuonRule(PRESETS["quintic"])
    assert rule.team_cost((64, 1024), 4).team_messages == 5
    assert rule.team_cost((64, 1024), 4).team_numel == team_work(64, 1024, 5, "standard", 4).numel
    assert dataclasses.replace(rule, compute_dtype=torch.float64).team_cost((64, 1024), 4).team_messages == 6
    rounds = 0
    run = team_newton_schulz(
        torch.randn(64, 256), (64, 1024), PRESETS["quintic"], 5, 1e-7, torch.float32, 0, 4, "gram"
    )
    try:
        request = next(run)
        while True:
            rounds += 1
            request = run.send(tuple(r.tensor for r in request))
    except StopIteration:
        pass
    assert rounds == 2
