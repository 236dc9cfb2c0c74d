"""Projected latency of one optimizer step of a plan on a device model.

Per micro-group:

- **gather**: the busiest rank's one-directional volume over the link the mesh needs (NVLink
  within a node, InfiniBand once the mesh spans nodes), plus one message latency per peer;
- **compute**: the group's busiest host's FLOPs (the rule's ``cost.flops``, whatever cost the plan
  balanced) at the device's effective matmul rate; under ``sync`` every rank computes the whole
  group;
- **scatter**: like the gather; none under ``sync``.

Matrix-rule work only: the elementwise parts (momentum, the AdamW group) are accounted for by
`lightning_canzona.simulation.iteration`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_canzona.planning.plan import Plan
from lightning_canzona.planning.traffic import Exchange, Traffic, traffic
from lightning_canzona.simulation.device import DeviceModel
from lightning_canzona.simulation.pipeline import pipelined_time, sequential_time


@dataclass(frozen=True)
class StepProjection:
    """Projected optimizer-step times of a plan, per micro-group, in seconds.

    Attributes:
        policy: The plan's policy.
        link: The link the collectives cross (``NVLink`` or ``InfiniBand``).
        gathers: Gather time of each micro-group.
        computes: Host compute time of each micro-group.
        scatters: Scatter time of each micro-group.
    """

    policy: str
    link: str
    gathers: tuple[float, ...]
    computes: tuple[float, ...]
    scatters: tuple[float, ...]

    @property
    def communication(self) -> float:
        """Total gather and scatter time."""
        return sum(self.gathers) + sum(self.scatters)

    @property
    def compute(self) -> float:
        """Total host compute time."""
        return sum(self.computes)

    @property
    def sequential(self) -> float:
        """Step time without overlap."""
        return sequential_time(self.gathers, self.computes, self.scatters)

    @property
    def pipelined(self) -> float:
        """Step time with the gather/compute/scatter pipeline."""
        return pipelined_time(self.gathers, self.computes, self.scatters)


def collective_time(exchange: Exchange, bandwidth: float, latency: float) -> float:
    """Seconds of one collective: busiest rank's volume over ``bandwidth`` plus per-peer latency."""
    if exchange.busiest == 0:
        return 0.0
    return exchange.busiest / bandwidth + latency * exchange.max_peers


def project_step(
    plan: Plan, device: DeviceModel, element_bytes: int, compute_dtype: str, moved: Traffic | None = None
) -> StepProjection:
    """Project the optimizer step of ``plan``.

    Args:
        plan: The plan.
        device: GPU and links.
        element_bytes: Bytes per exchanged element (the rule's exchange dtype).
        compute_dtype: Dtype of the rule's matmuls (``bfloat16`` for Muon, ``float32`` for
            Shampoo and SOAP).
        moved: ``traffic(plan, element_bytes)`` when the caller has it already.

    Returns:
        Per-micro-group gather, compute and scatter times.
    """
    link, bandwidth, latency = device.link(plan.num_ranks)
    flops_per_second = device.matmul_flops(compute_dtype)
    moved = moved or traffic(plan, element_bytes)
    flops = [m.cost.flops for m in plan.matrices]
    computes = []
    for group in plan.micro_groups:
        if plan.owners is None:
            host_flops = sum(flops[i] for i in group)
        else:
            per_host: dict[int, float] = {}
            for index in group:
                per_host[plan.owners[index]] = per_host.get(plan.owners[index], 0.0) + flops[index]
            host_flops = max(per_host.values(), default=0.0)
        computes.append(host_flops / flops_per_second)
    return StepProjection(
        policy=plan.settings.policy,
        link=link,
        gathers=tuple(collective_time(e, bandwidth, latency) for e in moved.gathers),
        computes=tuple(computes),
        scatters=tuple(collective_time(e, bandwidth, latency) for e in moved.scatters),
    )
