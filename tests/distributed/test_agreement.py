"""`Reduction` and `agree_on_maximum`: every rank gets the same elementwise sum or maximum over
the ranks, small tensors in one round on gloo and large ones by gloo's all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist
from multiprocess import BACKEND, DEVICE, run_on_ranks

from lightning_canzona.distributed.agreement import ONE_ROUND_BYTES, Reduction, agree_on_maximum


def _values(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Per element, another rank holds the largest value; some are negative or infinite."""
    count = torch.Size(shape).numel()
    values = torch.arange(count, dtype=torch.float32, device=DEVICE).mul(7).add(3 * rank).remainder(11).sub(5)
    if count > 3:
        values[3] = -torch.inf if rank else 2.0
    return values.view(shape)


def _random(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(DEVICE)


def _agree(rank: int, world_size: int) -> None:
    all_reduce = dist.all_reduce
    calls: list[int] = []

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce  # this process only
    for shape in [(), (1,), (4, 47), (3, 2, 5)]:
        tensor = _values(rank, shape)
        agree_on_maximum(tensor)
        expected = torch.stack([_values(r, shape) for r in range(world_size)]).amax(dim=0)
        assert tensor.shape == shape and tensor.equal(expected), shape
    assert not calls or BACKEND != "gloo", "gloo's agreement must take one all-to-all, not a ring all-reduce"

    largest = ONE_ROUND_BYTES // 4
    for numel, rounds in ((5, "one"), (largest, "one"), (largest + 1, "ring")):
        calls.clear()
        tensor = _random(rank, numel)
        Reduction(tensor, dist.ReduceOp.SUM).wait()
        expected = torch.stack([_random(r, numel) for r in range(world_size)]).sum(dim=0)
        torch.testing.assert_close(tensor, expected)
        assert calls == ([] if rounds == "one" else [numel]) or BACKEND != "gloo", numel
        everyone = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(everyone, tensor)
        assert all(theirs.equal(tensor) for theirs in everyone), "ranks must get the same sums"

    pair = dist.new_group([0, 2])
    if rank in (0, 2):
        tensor = _values(rank, (6,))
        agree_on_maximum(tensor, pair)
        assert tensor.equal(torch.maximum(_values(0, (6,)), _values(2, (6,))))
        tensor = _values(rank, (6,))
        Reduction(tensor, dist.ReduceOp.SUM, pair).wait()
        assert tensor.equal(_values(0, (6,)) + _values(2, (6,)))


def test_every_rank_gets_the_elementwise_sum_and_maximum() -> None:
    run_on_ranks(3, _agree)
