"""Schedules of the micro-group pipeline: gather → compute → scatter per group.

Two resources: the network, which runs one collective at a time, and the compute units. Without
the pipeline every phase waits for the one before it. With it, the network runs
``gather 0, gather 1, scatter 0, gather 2, scatter 1, …, scatter n−1``: the gather of group
``i + 1`` overlaps the compute of group ``i``, and the scatter of group ``i`` overlaps the compute
of group ``i + 1`` (at most two groups' buffers in flight). At every instant the network or the
compute is busy — a waiting scatter means its compute is running, a waiting compute means its
gather (earlier in the network order) is running — so the pipelined time never exceeds the
sequential one.
"""

from __future__ import annotations

from collections.abc import Sequence


def sequential_time(gathers: Sequence[float], computes: Sequence[float], scatters: Sequence[float]) -> float:
    """Time when every gather, compute and scatter runs after the previous one."""
    return sum(gathers) + sum(computes) + sum(scatters)


def averaged_over_period(steady: float, peak: float, period: int) -> float:
    """A step's time averaged over ``period`` steps: ``steady`` on all but one, ``peak`` on the
    one that runs the periodic work (Shampoo's and SOAP's decompositions)."""
    return ((period - 1) * steady + peak) / period


def pipelined_time(gathers: Sequence[float], computes: Sequence[float], scatters: Sequence[float]) -> float:
    """Time of the overlapped schedule described in the module docstring."""
    count = len(gathers)
    if not (len(computes) == len(scatters) == count):
        raise ValueError("gathers, computes and scatters need one entry per micro-group")
    if count == 0:
        return 0.0
    gather_done = [0.0] * count
    compute_done = [0.0] * count
    network_free = 0.0
    compute_free = 0.0
    end = 0.0

    def run_gather(group: int) -> None:
        nonlocal network_free
        network_free += gathers[group]
        gather_done[group] = network_free

    def run_compute(group: int) -> None:
        nonlocal compute_free
        compute_free = max(compute_free, gather_done[group]) + computes[group]
        compute_done[group] = compute_free

    def run_scatter(group: int) -> None:
        nonlocal network_free, end
        network_free = max(network_free, compute_done[group]) + scatters[group]
        end = max(end, network_free)

    run_gather(0)
    for group in range(count):
        run_compute(group)  # only depends on gathers already issued
        if group + 1 < count:
            run_gather(group + 1)
        run_scatter(group)
    return max(end, compute_free)
