"""Fault injection: one rank fails, every rank raises the same error in seconds, nothing drifts.

Each body runs on 2 and 4 ranks with a 30-second collective timeout: a rank left waiting in
a collective fails the test with a timeout instead of hanging the suite. (That a failed save
leaves the last good checkpoint loadable is tested in ``test_checkpoints.py``.)
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from multiprocess import DEVICE, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import lightning_canzona as lc
from lightning_canzona.distributed.agreement import (
    GradientAgreement,
    average_gradients,
    check_gradients_agree,
)
from lightning_canzona.distributed.clipping import total_grad_norm
from lightning_canzona.preparation import unsharded_parameters
from lightning_canzona.rules.muon import MuonRule

TIMEOUT = 30.0
MUON = {"lr": 0.02, "compute_dtype": "float32", "adamw_lr": 0.01}


def _expect_everywhere(error: type[Exception], pattern: str, action) -> pytest.ExceptionInfo:
    with pytest.raises(error, match=pattern) as raised:
        action()
    dist.barrier()  # every rank got here: nobody is left in a collective
    return raised


def _sharded(full: torch.Tensor, mesh, placements) -> nn.Parameter:
    return nn.Parameter(distribute_tensor(full, mesh, placements, src_data_rank=None))


def _snapshot(params) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in params]


def _one_rank_fails(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (world_size,))
    last = world_size - 1
    torch.manual_seed(0)
    plain, head = nn.Parameter(torch.randn(6, 5, device=DEVICE)), nn.Parameter(torch.randn(5, device=DEVICE))
    matrices = [
        _sharded(torch.randn(4 * world_size + 3, 7, device=DEVICE), mesh, [Shard(0)])
        for _ in range(world_size)
    ]
    params = [plain, head, *matrices]
    optimizer = lc.Muon(
        [("plain", plain), ("head", head), *((f"matrix{i}", m) for i, m in enumerate(matrices))],
        **MUON,
        plan=lc.PlanConfig(policy="round_robin"),
    )
    for param in params:
        param.grad = torch.ones_like(param)

    # A NaN in a plain tensor's gradient on one rank only: every rank raises, nothing is written,
    # the sharded matrices included (the whole step is checked before any update).
    if rank == last:
        plain.grad[2, 3] = float("nan")
    before = _snapshot(params)
    _expect_everywhere(FloatingPointError, r"parameter 'plain' \(shape \(6, 5\)\) holds NaN", optimizer.step)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(params), before))

    # An exception inside the pipeline on one owner: the others finish the step's collectives,
    # and the next step's agreement on gradients (the step's one read of the device) raises the
    # same error on every rank, the failed rank with its own as the cause, before it changes
    # anything.
    plain.grad = torch.ones_like(plain)
    direction = MuonRule.direction

    def failing_direction(self, matrix, state):
        raise torch.OutOfMemoryError("injected on the last rank")

    MuonRule.direction = failing_direction if rank == last else direction
    try:
        optimizer.step()
    finally:
        MuonRule.direction = direction
    # A second optimizer in the same process (a GAN's other model) keeps an agreement of its own:
    # the first one's failure neither reaches its step nor stops it, and it steps as it would alone.
    full = torch.randn(2 * world_size + 1, 3, device=DEVICE)
    other_weight, alone = _sharded(full, mesh, [Shard(0)]), nn.Parameter(full.clone())
    other, reference = lc.Muon([("other", other_weight)], **MUON), lc.Muon([("other", alone)], **MUON)
    for _ in range(2):
        other_weight.grad, alone.grad = torch.ones_like(other_weight), torch.ones_like(alone)
        other.step()
        reference.step()
    torch.testing.assert_close(other_weight.full_tensor(), alone.detach(), rtol=1e-6, atol=1e-6)
    before = _snapshot(params)
    raised = _expect_everywhere(
        RuntimeError,
        rf"Muon.step failed on rank {last}: OutOfMemoryError\('injected on the last rank'\)\. "
        "Every rank stopped before changing anything else",
        optimizer.step,
    )
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError) == (rank == last)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(params), before))
    optimizer.step()  # the next step runs normally

    # A failed step that no step follows is raised before a checkpoint takes its state.
    MuonRule.direction = failing_direction if rank == last else direction
    try:
        optimizer.step()
    finally:
        MuonRule.direction = direction

    def save() -> None:
        with optimizer.whole_team_state():  # what saving a checkpoint enters first
            raise AssertionError("a failed step's state reached a checkpoint")

    _expect_everywhere(RuntimeError, rf"Muon.step failed on rank {last}", save)

    # Out of memory where the step reserves its buffers (its arena), on the last rank: every rank
    # raises at the step's agreement, before its first exchange and before any update, and the
    # error names the rank, the buffers' bytes and the setting to lower.
    for param in params:
        param.grad = torch.ones_like(param)
    before = _snapshot(params)
    with _failing(torch, "empty", rank == last, lambda *_, **__: _called_from("engine.py")):
        _expect_everywhere(
            RuntimeError,
            rf"Muon.step failed on rank {last}: OutOfMemoryError\(\"injected The step's buffers take "
            r"[0-9.]+ [KMG]?i?B on this rank \(its largest micro-group [0-9.]+ [KMG]?i?B\) with "
            r"PlanConfig\(memory_budget='auto'\): lower memory_budget",
            optimizer.step,
        )
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(params), before))
    # ...and mid-step: every copy into the step's buffers fails on the last rank. It joins the
    # step's remaining collectives with what its buffers hold; the next agreement raises.
    with _failing(torch, "cat", rank == last, lambda *_, **__: _called_from("runtime.py")):
        optimizer.step()
    _expect_everywhere(
        RuntimeError, rf"Muon.step failed on rank {last}: OutOfMemoryError", optimizer.agreement.settle
    )
    optimizer.step()  # and the next step runs normally


@contextlib.contextmanager
def _failing(module, name: str, here: bool, when) -> Iterator[None]:
    """``module.name`` raising an out-of-memory error on this rank if ``here``, where ``when(*args)``."""
    original = getattr(module, name)

    def failing(*args, **kwargs):
        if when(*args, **kwargs):
            raise torch.OutOfMemoryError("injected")
        return original(*args, **kwargs)

    setattr(module, name, failing if here else original)
    try:
        yield
    finally:
        setattr(module, name, original)


def _called_from(filename: str) -> bool:
    """Whether the caller of the function that asks was defined in ``filename``."""
    return sys._getframe(3).f_code.co_filename.endswith(filename)


def _mixed_gradients(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (world_size,))
    torch.manual_seed(0)
    full, bias = torch.randn(2 * world_size + 1, 6, device=DEVICE), torch.randn(6, device=DEVICE)
    partials = [torch.randn(full.shape, device=DEVICE) for _ in range(world_size)]
    partials[0].zero_()  # rank 0 holds no gradient: it counts as zeros

    def fresh():
        weight = _sharded(full, mesh, [Shard(0)])
        replicated = _sharded(bias, mesh, [Replicate()])
        # The others' gradients are Partial (a sum still to be taken): turning them into the
        # weight's Shard(0) is a collective that rank 0, whose gradient is None, must join.
        weight.grad = None if rank == 0 else DTensor.from_local(partials[rank], mesh, [Partial()])
        # A replicated parameter whose gradient only some ranks hold: replicas must not drift.
        replicated.grad = (
            None
            if rank == 1
            else distribute_tensor(torch.ones(6, device=DEVICE), mesh, [Replicate()], src_data_rank=None)
        )
        return weight, replicated

    weight, replicated = fresh()
    expected_norm = math.hypot(float(sum(partials).norm()), float(torch.ones(6).norm()))
    torch.testing.assert_close(float(total_grad_norm([weight, replicated])), expected_norm, rtol=1e-5, atol=0)

    weight, replicated = fresh()
    optimizer = lc.Muon([("weight", weight), ("bias", replicated)], **MUON)
    reference_weight, reference_bias = nn.Parameter(full.clone()), nn.Parameter(bias.clone())
    reference = lc.Muon([("weight", reference_weight), ("bias", reference_bias)], **MUON)
    reference_weight.grad, reference_bias.grad = sum(partials), torch.ones(6, device=DEVICE)
    for _ in range(3):
        optimizer.step()
        reference.step()
    torch.testing.assert_close(weight.full_tensor(), reference_weight.detach(), rtol=1e-5, atol=1e-6)
    replicas = [torch.empty(6, device=DEVICE) for _ in range(world_size)]
    dist.all_gather(replicas, replicated.to_local())
    assert all(torch.equal(replica, replicas[0]) for replica in replicas)
    torch.testing.assert_close(replicas[0], reference_bias.detach(), rtol=1e-5, atol=1e-6)


def _a_tensor_parallel_weight_left_out_of_fsdp2(rank: int, world_size: int) -> None:
    # A DTensor on the tensor-parallel mesh alone (a weight tied across two FSDP2 units): DTensor
    # reduces its gradient over that mesh only, so each data-parallel rank holds its own.
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    tied = _sharded(torch.zeros(4, 3), mesh["tensor_parallel"], [Shard(0)])
    module = nn.ParameterDict(
        {
            "tied": tied,
            "sharded": _sharded(torch.zeros(4, 3), mesh["data_parallel"], [Shard(0)]),  # as FSDP2's
            "both": _sharded(torch.zeros(4, 3), mesh, [Shard(0), Shard(1)]),
        }
    )
    assert [name for name, _ in unsharded_parameters(module, mesh["data_parallel"], world_size)] == ["tied"]
    # Averaged part by part, laid out as before; rank 0, without a gradient, adds zeros.
    local = torch.full((4, 3), float(rank))
    tied.grad = None if rank == 0 else DTensor.from_local(local, mesh["tensor_parallel"], [Shard(0)])
    average_gradients([tied], mesh["data_parallel"].get_group(), GradientAgreement())
    assert isinstance(tied.grad, DTensor) and tied.grad.placements == (Shard(0),)
    assert torch.equal(tied.grad.to_local(), torch.full((4, 3), (world_size - 1) / 2))


def _plain_gradients_across_ranks(rank: int, world_size: int) -> None:
    _a_tensor_parallel_weight_left_out_of_fsdp2(rank, world_size)
    torch.manual_seed(rank)  # each rank its own data
    named = [
        (name, nn.Parameter(torch.zeros(3, 2, device=DEVICE))) for name in ("embedding", "norm", "unused")
    ]
    grads = (torch.randn(3, 2, device=DEVICE), torch.randn(3, 2, device=DEVICE), None)
    for (_, param), grad in zip(named, grads):
        param.grad = grad
    agreement = GradientAgreement()
    average_gradients([param for _, param in named], dist.group.WORLD, agreement)
    check_gradients_agree(named, agreement)  # averaged: every rank agrees
    # Both read nothing: the next agreement on gradients reads their verdicts.
    assert named[2][1].grad is not None
    agreement.agree_for_step(named)
    assert named[2][1].grad is None
    # A gradient that tensor parallelism leaves different per rank is named on every rank.
    named[1][1].grad += rank
    check_gradients_agree(named, agreement)
    _expect_everywhere(
        RuntimeError,
        r"plain \(non-DTensor\) parameters \['norm'\] differ",
        lambda: agreement.agree_for_step(named),
    )


def _decomposition_fails_on_the_owner(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (world_size,))
    torch.manual_seed(0)
    weight = _sharded(torch.randn(3 * world_size, 5, device=DEVICE), mesh, [Shard(0)])
    optimizer = lc.Shampoo(
        [("weight", weight)],
        lr=0.01,
        start_preconditioning_step=1,
        precondition_frequency=1,
        plan=lc.PlanConfig(policy="lpt"),
    )
    eigh = torch.linalg.eigh

    def failing_eigh(matrix, *args, **kwargs):
        # Step 1: every precision fails; step 2: float32 only, which the float64 retry mends.
        if step == 1 or matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("injected: the eigensolver did not converge")
        return eigh(matrix, *args, **kwargs)

    counts = torch.zeros(2, device=DEVICE)
    for step in range(3):
        weight.grad = distribute_tensor(
            torch.randn(weight.shape, device=DEVICE), mesh, [Shard(0)], src_data_rank=None
        )
        torch.linalg.eigh = eigh if step == 0 else failing_eigh
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer.step()
        finally:
            torch.linalg.eigh = eigh
        (engine,) = optimizer.engines.values()
        counts += torch.tensor(
            [engine.stats.decomposition_failures, engine.stats.decomposition_retries], device=DEVICE
        )
        failed = any("failed; the previous one is kept" in str(w.message) for w in caught)
        assert failed == bool(engine.stats.decomposition_failures)
    dist.all_reduce(counts)
    # Both factors of the one matrix, on its owner: retried at steps 1 and 2, failed at step 1.
    assert counts.tolist() == [2, 4]
    assert torch.isfinite(weight.full_tensor()).all()


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_failure_on_one_rank_is_the_same_error_on_every_rank(world_size) -> None:
    run_on_ranks(world_size, _one_rank_fails, timeout=TIMEOUT)


@pytest.mark.parametrize("world_size", [2, 4])
def test_partial_and_missing_gradients_never_hang_or_let_replicas_drift(world_size) -> None:
    run_on_ranks(world_size, _mixed_gradients, timeout=TIMEOUT)


def test_plain_parameters_are_averaged_and_a_split_gradient_is_refused_on_every_rank() -> None:
    run_on_ranks(2, _plain_gradients_across_ranks, timeout=TIMEOUT)


def test_a_failed_decomposition_keeps_the_previous_root_and_is_counted() -> None:
    run_on_ranks(2, _decomposition_fails_on_the_owner, timeout=TIMEOUT)
