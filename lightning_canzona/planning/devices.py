"""What a GPU and its interconnect can do: the prices the planner charges for collectives
(`CollectivePrices`), and the rates the simulator (`lightning_canzona.tools.simulation`) turns
work into time with. `H100` and `H200` are datasheet peaks scaled by an assumed achievable
fraction; docs/planning.md#device-model gives each figure and its source."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Protocol, TypeVar

import torch

_TERA = 1e12
_GIGA = 1e9


@dataclass(frozen=True)
class CollectivePrices:
    """What collectives cost the planner, in FLOPs of the same time (`PlanSettings` holds one).

    Attributes:
        flops_per_element: One element sent to another rank of a team (within a node).
        flops_per_message: One collective's latency, within a node.
        exchange_flops_per_element: One element a gather or scatter moves for its busiest rank.
        exchange_flops_per_message: One peer that a gather or scatter exchanges with.
    """

    flops_per_element: float
    flops_per_message: float
    exchange_flops_per_element: float
    exchange_flops_per_message: float


#: The names of `CollectivePrices`' fields, in order.
PRICE_NAMES: tuple[str, ...] = tuple(f.name for f in fields(CollectivePrices))


class _HoldsPrices(Protocol):
    """Settings that hold `CollectivePrices` and take its fields as keywords (`PlanSettings`)."""

    @property
    def prices(self) -> CollectivePrices: ...


_Settings = TypeVar("_Settings", bound=_HoldsPrices)


@dataclass(frozen=True)
class DeviceModel:
    """A GPU type and the links between GPUs: peak FLOP/s of dense matmuls (``fp32_flops``
    without TF32), the fraction of peak the optimizer's matmuls reach, HBM bytes/s, and per GPU
    and direction the bytes/s and seconds per message of NVLink (within a node of
    ``gpus_per_node``) and of InfiniBand (across nodes)."""

    name: str
    bf16_flops: float
    fp32_flops: float
    fp64_flops: float
    achievable_fraction: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if not 0.0 < self.achievable_fraction <= 1.0:
            raise ValueError(f"achievable_fraction must lie in (0, 1], got {self.achievable_fraction}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def matmul_flops(self, dtype: str) -> float:
        """Effective FLOP/s of matmuls in ``dtype`` (``bfloat16``, ``float32`` or ``float64``)."""
        peaks = {"bfloat16": self.bf16_flops, "float32": self.fp32_flops, "float64": self.fp64_flops}
        if dtype not in peaks:
            raise ValueError(f"dtype must be one of {sorted(peaks)}, got {dtype!r}")
        return peaks[dtype] * self.achievable_fraction

    def prices(self, matmul_dtype: str, element_bytes: int) -> CollectivePrices:
        """Prices of collectives in FLOPs of ``matmul_dtype`` matmuls, for elements of ``element_bytes``."""
        rate = self.matmul_flops(matmul_dtype)
        _, team_bandwidth, team_latency = self.link(self.gpus_per_node)
        _, mesh_bandwidth, mesh_latency = self.link(self.gpus_per_node + 1)
        return CollectivePrices(
            flops_per_element=rate * element_bytes / team_bandwidth,
            flops_per_message=rate * team_latency,
            exchange_flops_per_element=rate * element_bytes / mesh_bandwidth,
            exchange_flops_per_message=rate * mesh_latency,
        )

    def plan_prices(self, matmul_dtype: str, element_bytes: int) -> dict[str, float]:
        """`prices` as a dict, by field name."""
        return asdict(self.prices(matmul_dtype, element_bytes))

    def repriced(self, settings: _Settings, matmul_dtype: torch.dtype) -> _Settings:
        """``settings`` with its prices (bf16 FLOPs, 2-byte elements) turned into ``matmul_dtype``'s."""
        name = str(matmul_dtype).removeprefix("torch.")
        target, reference = self.plan_prices(name, matmul_dtype.itemsize), self.plan_prices("bfloat16", 2)
        given = asdict(settings.prices)
        return replace(settings, **{key: given[key] * target[key] / reference[key] for key in given})

    def link(self, num_ranks: int) -> tuple[str, float, float]:
        """``(name, bytes/s, seconds per message)`` of the slowest link ``num_ranks`` GPUs span."""
        if num_ranks > self.gpus_per_node:
            return "InfiniBand", self.inter_node_bandwidth, self.inter_node_latency
        return "NVLink", self.intra_node_bandwidth, self.intra_node_latency


H100 = DeviceModel(
    name="H100 SXM",
    bf16_flops=989.4 * _TERA,
    fp32_flops=67 * _TERA,
    fp64_flops=67 * _TERA,
    achievable_fraction=0.6,
    hbm_bandwidth=3350 * _GIGA,
    intra_node_bandwidth=450 * _GIGA,
    intra_node_latency=3e-6,
    inter_node_bandwidth=50 * _GIGA,
    inter_node_latency=6e-6,
)

#: The same GH100 compute and NVLink as the H100; only the memory (HBM3e) is faster.
H200 = replace(H100, name="H200 SXM", hbm_bandwidth=4800 * _GIGA)

DEVICES: dict[str, DeviceModel] = {"h100": H100, "h200": H200}
