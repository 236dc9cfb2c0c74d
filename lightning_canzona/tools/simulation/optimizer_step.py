"""Projected latency of one optimizer step of a plan on a device model.

Per micro-group:

- **gather**: the busiest rank's one-directional volume over the link the mesh needs (NVLink
  within a node, InfiniBand once the mesh spans nodes), plus one message latency per peer;
- **compute**: the group's busiest host's FLOPs (the rule's cost, whatever cost the plan
  balanced) at the device's effective matmul rate; under ``sync`` every rank computes the whole
  group; a team's member computes its own FLOPs (`UpdateCost.member_flops_of`) and adds the
  team's collectives (``team_messages`` latencies and ``team_numel`` elements over the link the
  team spans);
- **scatter**: like the gather; none under ``sync``.

Every matrix of a rule runs its periodic work (Shampoo's and SOAP's decompositions) on the same
steps, one in ``period`` (`UpdateCost.periodic_flops`): the step is projected without it and with
it, and the times are averaged over the period (a step waits for its busiest host, so the
decompositions that crowd onto a few ranks are paid on those steps in full).

Matrix-rule work only: the elementwise parts (momentum, the AdamW group) are accounted for by
`lightning_canzona.tools.simulation.iteration`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_canzona.planning.devices import DeviceModel
from lightning_canzona.planning.plan import Plan, averaged_over_period, pipelined_time, sequential_time
from lightning_canzona.rules.base import UpdateCost
from lightning_canzona.tools.simulation.traffic import Exchange, Traffic, traffic


@dataclass(frozen=True)
class StepProjection:
    """Projected optimizer-step times of a plan, per micro-group, in seconds.

    Attributes:
        policy: The plan's policy.
        link: The link the collectives cross (``NVLink`` or ``InfiniBand``).
        gathers: Gather time of each micro-group.
        computes: Host compute time of each micro-group on a step without periodic work.
        scatters: Scatter time of each micro-group.
        peak_computes: The same on a step with it (empty: none).
        period: Steps between runs of the periodic work.
    """

    policy: str
    link: str
    gathers: tuple[float, ...]
    computes: tuple[float, ...]
    scatters: tuple[float, ...]
    peak_computes: tuple[float, ...] = ()
    period: int = 1

    @property
    def communication(self) -> float:
        """Total gather and scatter time."""
        return sum(self.gathers) + sum(self.scatters)

    @property
    def compute(self) -> float:
        """Total host compute time, averaged over the period."""
        return self._averaged(sum)

    @property
    def sequential(self) -> float:
        """Step time without overlap, averaged over the period."""
        return self._averaged(lambda computes: sequential_time(self.gathers, computes, self.scatters))

    @property
    def pipelined(self) -> float:
        """Step time with the gather/compute/scatter pipeline, averaged over the period."""
        return self._averaged(lambda computes: pipelined_time(self.gathers, computes, self.scatters))

    @property
    def peak_pipelined(self) -> float:
        """Pipelined time of a step that runs the periodic work."""
        return pipelined_time(self.gathers, self.peak_computes or self.computes, self.scatters)

    def _averaged(self, time: Callable[[tuple[float, ...]], float]) -> float:
        if not self.peak_computes:
            return time(self.computes)
        return averaged_over_period(time(self.computes), time(self.peak_computes), self.period)


def collective_time(exchange: Exchange, bandwidth: float, latency: float) -> float:
    """Seconds of one collective: busiest rank's volume over ``bandwidth`` plus per-peer latency."""
    if exchange.busiest == 0:
        return 0.0
    return exchange.busiest / bandwidth + latency * exchange.max_peers


def _member_seconds(
    cost: UpdateCost,
    team: int,
    member: int,
    device: DeviceModel,
    flops_per_second: float,
    element_bytes: int,
    peak: bool,
) -> float:
    """Team member ``member``'s time on one matrix, on a step with the periodic work if
    ``peak``, else without it: its FLOPs, then (teams only) the team's collectives, which it
    waits for (not overlapped, a conservative projection)."""
    seconds = cost.step_flops_of(member, peak) / flops_per_second
    if team > 1:
        _, bandwidth, latency = device.link(team)
        seconds += cost.team_messages * latency + cost.team_numel * element_bytes / bandwidth
    return seconds


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

    def seconds(index: int, team: int, member: int, peak: bool) -> float:
        cost = plan.matrices[index].member_cost(team)
        return _member_seconds(cost, team, member, device, flops_per_second, element_bytes, peak)

    def computes(peak: bool) -> tuple[float, ...]:
        times = []
        for group in plan.micro_groups:
            if plan.teams is None:  # every rank computes every matrix
                times.append(sum(seconds(index, 1, 0, peak) for index in group))
                continue
            per_host: dict[int, float] = {}
            for index in group:
                team = plan.teams[index]
                for member, rank in enumerate(team):
                    per_host[rank] = per_host.get(rank, 0.0) + seconds(index, len(team), member, peak)
            times.append(max(per_host.values(), default=0.0))
        return tuple(times)

    periodic = plan.period > 1
    return StepProjection(
        policy=plan.settings.policy,
        link=link,
        gathers=tuple(collective_time(e, bandwidth, latency) for e in moved.gathers),
        computes=computes(peak=False),
        scatters=tuple(collective_time(e, bandwidth, latency) for e in moved.scatters),
        peak_computes=computes(peak=True) if periodic else (),
        period=plan.period,
    )
