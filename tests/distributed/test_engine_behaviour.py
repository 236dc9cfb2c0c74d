"""The engine's promises beyond exactness: non-redundancy, collective counts, and clear errors."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from multiprocess import BACKEND, DEVICE, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_canzona as lc
from lightning_canzona.planning.memory import GroupBuffers, estimated_buffers
from lightning_canzona.rules.muon import MuonRule


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(40, 96, bias=False)
        self.down = nn.Linear(96, 40, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Blocks(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(40, 10)


def _sharded_blocks(mesh) -> Blocks:
    torch.manual_seed(0)
    model = Blocks().to(DEVICE)
    plan = {f"layers.{i}.up": ColwiseParallel() for i in range(3)}
    plan |= {f"layers.{i}.down": RowwiseParallel() for i in range(3)}
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _counts(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    calls: list[int] = []
    direction = MuonRule.direction

    def recording_direction(self, matrix, state):
        calls.append(id(state))
        return direction(self, matrix, state)

    all_to_all = dist.all_to_all_single
    collectives = Counter()

    def counting_all_to_all(*args, **kwargs):
        collectives["all_to_all"] += 1
        return all_to_all(*args, **kwargs)

    MuonRule.direction = recording_direction
    dist.all_to_all_single = counting_all_to_all
    try:
        for policy in ("canzona", "lpt", "round_robin", "sync"):
            model = _sharded_blocks(mesh)
            optimizer = lc.Muon(
                lc.matrix_param_groups(model), plan=lc.PlanConfig(policy, micro_group_capacity=1.0)
            )
            for _ in range(2):
                for param in model.parameters():
                    param.grad = torch.ones_like(param)
                calls.clear()
                collectives.clear()
                optimizer.step()
            engine = next(iter(optimizer.engines.values()))
            names = {id(optimizer.state[entry.param]): entry.name for entry in engine.entries}
            computed = [names[call] for call in calls]
            everyone: list[list[str]] = [None] * world_size  # type: ignore[list-item]
            dist.all_gather_object(everyone, computed)
            plan = engine.plan
            matrices = [m.name for m in plan.matrices]
            assert len(matrices) == 6  # head.weight is an output head: AdamW
            # Besides the exchanges, gloo agrees on the gradients (and the previous step's
            # failure flag with them) by one all-to-all (NCCL by an all-reduce).
            agreements = 1 if BACKEND == "gloo" else 0
            if policy == "sync":
                assert all(sorted(theirs) == sorted(matrices) for theirs in everyone)
                assert collectives["all_to_all"] == len(plan.micro_groups) + agreements
            else:
                assert sorted(sum(everyone, [])) == sorted(matrices), f"{policy}: each matrix exactly once"
                for index, name in enumerate(matrices):
                    assert name in everyone[plan.owners[index]], f"{policy}: {name} not on its owner"
                # A capacity of 1 FLOP puts every matrix in a micro-group of its own.
                assert len(plan.micro_groups) == 6
                assert collectives["all_to_all"] == 2 * len(plan.micro_groups) + agreements
    finally:
        MuonRule.direction = direction
        dist.all_to_all_single = all_to_all


def test_each_matrix_is_computed_once_on_its_owner_with_two_all_to_alls_per_micro_group() -> None:
    run_on_ranks(4, _counts)


def _buffers_per_group_in_flight(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (world_size,))
    torch.manual_seed(0)
    model = Blocks(depth=8).to(DEVICE)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups = lc.matrix_param_groups(model)
    for overlap in (True, False):
        # A capacity below any matrix's cost: each of the 16 matrices is a micro-group of its own.
        optimizer = lc.Muon(groups, plan=lc.PlanConfig(micro_group_capacity=1.0, overlap=overlap))
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        for _ in range(2):
            optimizer.step()
        (engine,) = optimizer.engines.values()
        assert len(engine.plan.micro_groups) == 16
        # Every group's buffers are given up once it is done: the arena holds at most the
        # pipeline's three groups (gathering, computing, scattering) at once, not all 16.
        # The plan's memory model counts exactly the buffers the step lays out, and their arena.
        plan = engine.plan
        modelled = estimated_buffers(plan.matrices, plan.teams, plan.micro_groups, world_size)[rank]
        for laid_out, estimate in zip(engine.layout.buffers, modelled, strict=True):
            assert all(getattr(laid_out, n) == getattr(estimate, n) for n in GroupBuffers.ARENA), estimate
        assert plan.rank_memory()[rank].arena == engine.layout.arena_bytes
        everything = sum(getattr(b, name) for b in engine.layout.buffers for name in GroupBuffers.ARENA)
        assert 0 < engine.layout.arena_bytes <= 0.3 * everything, (overlap, engine.layout.arena_bytes)
        assert engine.stats.peak_buffer_bytes <= 0.3 * engine.meter.total, (overlap, engine.meter.peak)
        # Nothing outlives the step: gloo's threads drop the last buffers a moment after wait().
        deadline = time.monotonic() + 10.0
        while engine.meter.live and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.meter.live == 0, engine.meter.live

    # Packing a buffer and assembling a matrix are one kernel each, whatever the number of
    # pieces (16 matrices in one micro-group: 8 to send to the other rank, 2 pieces each to
    # assemble), not a copy per piece from Python: the step is launch-bound on a GPU otherwise.
    optimizer = lc.Muon(groups, plan=lc.PlanConfig(micro_group_capacity=1e18))
    optimizer.step()
    (engine,) = optimizer.engines.values()
    (members,) = engine.plan.micro_groups
    assert len(members) == 16
    kernels = _exchange_kernels(optimizer.step)
    computed = 8  # each rank owns half the matrices
    # The gather packs its send buffer and the pieces it keeps, the scatter its send buffer and
    # this rank's own updates: one kernel each.
    expected = {"pack_gather": 2, "assemble": computed, "pack_scatter": 2, "my_updates": 0}
    assert kernels == expected, kernels


#: What issues a kernel that moves data, at the dispatcher's top level (inside ``aten::cat`` a
#: CPU copies input by input; on a GPU it is one batched kernel).
MOVES = {"aten::copy_", "aten::cat", "aten::clone", "aten::_to_copy", "aten::index_put_"}


def _exchange_kernels(step) -> dict[str, int]:
    """Data-moving kernels issued by each `MicroGroupExchange` method during ``step()``."""
    from lightning_canzona.distributed.runtime import MicroGroupExchange

    methods = ("pack_gather", "assemble", "pack_scatter", "my_updates")
    originals = {name: getattr(MicroGroupExchange, name) for name in methods}

    def labelled(name, method):
        def run(*args, **kwargs):
            with torch.profiler.record_function(f"exchange.{name}"):
                return method(*args, **kwargs)

        return run

    try:
        for name, method in originals.items():
            setattr(MicroGroupExchange, name, labelled(name, method))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            step()
    finally:
        for name, method in originals.items():
            setattr(MicroGroupExchange, name, method)
    counts = dict.fromkeys(methods, 0)
    for event in profile.events():
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        label = next((a for a in ancestors if a.startswith("exchange.")), None)
        if event.name in MOVES and label and not any(a in MOVES for a in ancestors):
            counts[label.removeprefix("exchange.")] += 1
    return counts


def test_a_step_holds_the_buffers_of_the_micro_groups_in_flight_only() -> None:
    run_on_ranks(2, _buffers_per_group_in_flight)


def _expect_everywhere(error: type[Exception], pattern: str, action) -> None:
    with pytest.raises(error, match=pattern):
        action()
    dist.barrier()  # every rank got here: nobody hangs in a collective


def _bad_input(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.randn(8, 6, device=DEVICE)

    # Rank 0's local tensor has a row more than its placements give it: no layout fits.
    rows = 3 if rank == 0 else 2
    scattered = nn.Parameter(
        DTensor.from_local(
            torch.randn(rows, 6, device=DEVICE),
            mesh,
            [Shard(0), Shard(0)],
            shape=full.shape,
            stride=full.stride(),
        )
    )
    optimizer = lc.Muon([("scattered.weight", scattered)])
    scattered.grad = torch.zeros_like(scattered)
    _expect_everywhere(
        RuntimeError,
        r"Cannot rebuild parameter 'scattered.weight' of shape \(8, 6\).*do not match placements",
        optimizer.step,
    )

    bias = nn.Parameter(
        distribute_tensor(torch.zeros(8, device=DEVICE), mesh, [Shard(0), Shard(0)], src_data_rank=None)
    )
    _expect_everywhere(
        ValueError,
        r"Parameter 'bias' of shape \(8,\), placements \(Shard\(dim=0\), Shard\(dim=0\)\) "
        r"is in a 'muon' group",
        lambda: lc.Muon([{"params": [("bias", bias)], "algorithm": "muon"}]),
    )

    weight = nn.Parameter(distribute_tensor(full, mesh, [Shard(0), Shard(1)], src_data_rank=None))
    optimizer = lc.Muon([("weight", weight)])
    grad = torch.zeros_like(full)
    if rank == 3:
        grad[7, 5] = float("nan")  # in rank 3's block only: every rank must still raise
    weight.grad = distribute_tensor(grad, mesh, [Shard(0), Shard(1)], src_data_rank=None)
    before = weight.to_local().clone()
    _expect_everywhere(
        FloatingPointError, r"parameter 'weight' \(shape \(8, 6\)\) holds NaN or Inf", optimizer.step
    )
    assert torch.equal(weight.to_local(), before)


def test_bad_input_raises_a_clear_error_on_every_rank() -> None:
    run_on_ranks(4, _bad_input)


def _step_both(distributed, reference, params, reference_params, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param, twin in zip(params, reference_params):
            full = torch.randn(twin.shape, generator=generator).to(DEVICE)
            twin.grad = full
            param.grad = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        distributed.step()
        reference.step()


def _replicated_and_replanned(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    layouts = {
        "replicated": [Replicate(), Replicate()],
        "dp-sharded, tp-replicated": [Shard(0), Replicate()],
        "dp-replicated, tp-sharded cols": [Replicate(), Shard(1)],
    }
    torch.manual_seed(0)
    fulls = [torch.randn(shape).to(DEVICE) for shape in ((24, 10), (9, 30), (16, 16), (12, 20))]
    params = [
        nn.Parameter(distribute_tensor(full, mesh, placements, src_data_rank=None))
        for full, placements in zip(fulls, [*layouts.values(), [Shard(0), Shard(1)]])
    ]
    twins = [nn.Parameter(full.clone()) for full in fulls]
    settings = dict(lr=1e-2, precondition_frequency=2)
    distributed = lc.SOAP([(f"m{i}", p) for i, p in enumerate(params[:3])], **settings)
    reference = lc.SOAP([(f"m{i}", p) for i, p in enumerate(twins[:3])], **settings)
    _step_both(distributed, reference, params[:3], twins[:3], steps=3, seed=1)

    # Matrix state lives on the owner only, in full.
    engine = next(iter(distributed.engines.values()))
    for index, param in enumerate(params[:3]):
        owned = engine.plan.owners[index] == rank
        assert ("left_basis" in distributed.state[param]) == owned
    first_owners = engine.plan.owners

    # A new parameter changes the plan: an owner moves, and its matrix state moves with it.
    distributed.add_param_group({"params": [("m3", params[3])]})
    reference.add_param_group({"params": [("m3", twins[3])]})
    _step_both(distributed, reference, params, twins, steps=3, seed=2)
    assert engine.plan.owners[:3] != first_owners, "these shapes move m2 to another owner"
    for index, (param, twin) in enumerate(zip(params, twins)):
        torch.testing.assert_close(param.full_tensor(), twin.detach(), rtol=1e-5, atol=1e-6, msg=f"m{index}")
        assert ("left_basis" in distributed.state[param]) == (engine.plan.owners[index] == rank)


def test_replicated_layouts_are_exact_and_state_follows_a_replanned_owner() -> None:
    run_on_ranks(4, _replicated_and_replanned)


class Experts(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(count, 16, 12))


def _experts_where_they_lie(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(Experts(2 * world_size), Experts(world_size + 1)).to(DEVICE)
    full = [layer.weight.detach().clone() for layer in model]
    for layer in model:
        fully_shard(layer, mesh=mesh)  # split on the expert dimension: each expert whole on one rank
    groups = lc.matrix_param_groups(model)
    assert [name for name, _ in groups[0]["params"]] == ["0.weight", "1.weight"]  # experts: matrices
    shapes, direction = [], MuonRule.direction

    def recording(self, matrix, state):
        shapes.append(tuple(matrix.shape))
        return direction(self, matrix, state)

    MuonRule.direction = recording
    try:
        sent = {}
        for locality in (True, False):
            optimizer = lc.Muon(groups, lr=0.02, compute_dtype="float32")
            optimizer.locality = locality
            for layer in model:
                layer.weight.grad = torch.ones_like(layer.weight)
            shapes.clear()
            optimizer.step()
            (engine,) = optimizer.engines.values()
            plan = engine.plan
            # Each expert is its own matrix in the plan, named by its index in the stack.
            assert [m.name for m in plan.matrices][:3] == ["0.weight[0]", "0.weight[1]", "0.weight[2]"]
            assert len(plan.matrices) == 3 * world_size + 1
            sent[locality] = torch.tensor(float(engine.stats.bytes_sent), device=DEVICE)
            dist.all_reduce(sent[locality])
            if locality:
                assert all(plan.owners[i] in m.holders for i, m in enumerate(plan.matrices))
                # This rank's experts of one shape, in one batched call per micro-group.
                owned = [m for i, m in enumerate(plan.matrices) if plan.owners[i] == rank]
                assert sum(s[0] if len(s) == 3 else 1 for s in shapes) == len(owned)
                assert any(len(s) == 3 and s[0] >= 2 for s in shapes), shapes
        assert sent[True] == 0  # every update computed where its expert lies
        assert sent[False] > 0
    finally:
        MuonRule.direction = direction
    # Still exact: the same updates as one step each of two one-process optimizers on the stacks.
    reference = [nn.Parameter(w) for w in full]
    for _ in range(2):
        for param in reference:
            param.grad = torch.ones_like(param)
        lc.Muon(list(zip(("0.weight", "1.weight"), reference)), lr=0.02, compute_dtype="float32").step()
    for layer, expected in zip(model, reference):
        torch.testing.assert_close(layer.weight.full_tensor(), expected.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_experts_are_planned_one_by_one_and_updated_where_they_lie(world_size) -> None:
    run_on_ranks(world_size, _experts_where_they_lie)
