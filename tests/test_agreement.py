"""`agree_on_maximum`: every rank gets the elementwise maximum over the ranks, in one round on gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist
from multiprocess import run_on_ranks

from lightning_canzona.distributed.agreement import agree_on_maximum


def _values(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Per element, another rank holds the largest value; some are negative or infinite."""
    count = torch.Size(shape).numel()
    values = torch.arange(count, dtype=torch.float32).mul(7).add(3 * rank).remainder(11).sub(5)
    if count > 3:
        values[3] = -torch.inf if rank else 2.0
    return values.view(shape)


def _agree(rank: int, world_size: int) -> None:
    def no_all_reduce(*args, **kwargs):
        raise AssertionError("gloo's agreement must take one all-to-all, not a ring all-reduce")

    dist.all_reduce = no_all_reduce  # this process only: the path under test must not need it
    for shape in [(), (1,), (4, 47), (3, 2, 5)]:
        tensor = _values(rank, shape)
        agree_on_maximum(tensor)
        expected = torch.stack([_values(r, shape) for r in range(world_size)]).amax(dim=0)
        assert tensor.shape == shape and tensor.equal(expected), shape
    pair = dist.new_group([0, 2])
    if rank in (0, 2):
        tensor = _values(rank, (6,))
        agree_on_maximum(tensor, pair)
        assert tensor.equal(torch.maximum(_values(0, (6,)), _values(2, (6,))))


def test_every_rank_gets_the_elementwise_maximum() -> None:
    run_on_ranks(3, _agree)
