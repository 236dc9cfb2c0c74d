"""What the planner charges for collectives and for each dtype's FLOPs, on the job's devices.

`priced` turns a `PlanConfig`'s ``team_prices`` into the planner's settings, `flops_weights` weighs
the FLOPs of rules that multiply in different dtypes by time: docs/architecture.md#measured-prices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from lightning_canzona.config import TeamPrices
from lightning_canzona.distributed.agreement import Reduction
from lightning_canzona.distributed.runtime import Clock, Intervals
from lightning_canzona.planning import PlanSettings
from lightning_canzona.planning.devices import H100
from lightning_canzona.rules.base import summed_dtype

#: A matmul timed for its rate takes at least this long (seconds), unless it has `LARGEST_MATMUL`
#: rows: an H100 multiplies two 8192² bf16 matrices in about 1.1 ms.
TIMED_MATMUL_SECONDS = 0.02
LARGEST_MATMUL = 8192


def measure_team_costs(
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, float]:
    """The planner's prices of collectives (`PlanSettings` ``flops_per_element``, ``flops_per_message``
    and their ``exchange_`` pair), measured over ``group`` in FLOPs of a matmul in ``dtype``.
    Collective: the ranks agree on the slowest figures, so that all plan alike."""
    device = torch.device(device)
    matmul = _seconds_per_flop(device, dtype)
    summed = summed_dtype(dtype)
    one, many = torch.zeros(1, dtype=summed, device=device), torch.zeros(2**20, dtype=summed, device=device)
    latency = _seconds(lambda: Reduction(one, dist.ReduceOp.SUM, group).wait(), 20, device)
    # A ring all-reduce sends 2·(w − 1)/w elements per element reduced (what `team_numel` counts),
    # each worth ``summed.itemsize / dtype.itemsize`` elements of ``dtype``.
    world = dist.get_world_size(group)
    reduced = many.numel() * summed.itemsize / dtype.itemsize
    sent = 2 * (world - 1) / world * reduced if world > 1 else reduced
    summing_many = _seconds(lambda: Reduction(many, dist.ReduceOp.SUM, group).wait(), 3, device)
    per_element = max(summing_many - latency, 0.0) / sent
    figures = torch.tensor([latency, per_element, matmul], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    latency, per_element, seconds_per_flop = figures.tolist()
    return {
        "flops_per_element": per_element / seconds_per_flop,
        "flops_per_message": latency / seconds_per_flop,
        "exchange_flops_per_element": per_element / seconds_per_flop,
        "exchange_flops_per_message": latency / seconds_per_flop / max(world - 1, 1),
    }


def _seconds(work: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Seconds of one call of ``work`` on ``device``, after a warm-up call."""
    clock = Clock(device)
    work()
    interval = Intervals()
    start = clock.mark()
    for _ in range(repeats):
        work()
    interval.add(start, clock.mark())
    return interval.seconds / repeats


def _seconds_per_flop(device: torch.device, dtype: torch.dtype) -> float:
    """Seconds per FLOP of a square matmul in ``dtype``, at the first size that takes long enough."""
    size = 256
    while True:
        matrix = torch.randn(size, size, device=device).to(dtype)
        seconds = _seconds(functools.partial(torch.matmul, matrix, matrix), 3, device)
        if seconds >= TIMED_MATMUL_SECONDS or size >= LARGEST_MATMUL:
            return seconds / (2 * size**3)
        size *= 2


def flops_weights(
    prices: TeamPrices, group: dist.ProcessGroup, device: str, dtypes: Sequence[torch.dtype]
) -> dict[torch.dtype, float] | None:
    """What one FLOP of each of ``dtypes`` costs in FLOPs of the first one's time, so that a plan
    weighs param groups by time: from an H100's rates (``"h100"``), measured (``"measure"``;
    collective), or ``None`` for prices given as figures, which say nothing of the rates."""
    if len(set(dtypes)) <= 1:
        return dict.fromkeys(dtypes, 1.0)
    if prices == "h100":
        seconds = [1.0 / H100.matmul_flops(str(dtype).removeprefix("torch.")) for dtype in dtypes]
    elif prices == "measure":
        measured = [_seconds_per_flop(torch.device(device), dtype) for dtype in dtypes]
        agreed = torch.tensor(measured, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        seconds = agreed.tolist()
    else:
        return None
    return {dtype: each / seconds[0] for dtype, each in zip(dtypes, seconds)}


def priced(
    settings: PlanSettings, prices: TeamPrices, group: dist.ProcessGroup, device: str, dtype: torch.dtype
) -> PlanSettings:
    """``settings`` with the team prices ``prices``, in FLOPs of matrix products in ``dtype`` (the
    rule's `matmul_dtype`): an H100's (``"h100"``), measured over ``group`` (``"measure"``), or the
    given pair."""
    if prices == "h100":
        return H100.repriced(settings, dtype)
    if prices == "measure":
        return replace(settings, **measure_team_costs(group, device, dtype))
    per_element, per_message = prices  # type: ignore[misc]
    return replace(settings, flops_per_element=per_element, flops_per_message=per_message)
