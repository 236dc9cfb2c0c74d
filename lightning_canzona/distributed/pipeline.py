"""Micro-group pipelining: overlap the gather of the next group and the scatter of the previous
one with the current group's compute.

With overlap, the collectives are issued in the same order on every rank::

    gather 0, gather 1, [compute 0], scatter 0, gather 2, [compute 1], scatter 1, [apply 0], …

so while group ``i`` computes, group ``i+1``'s shards are in flight towards their owners and
group ``i−1``'s updates towards their shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class GroupStep(Protocol):
    """One micro-group's work, in four phases."""

    def launch_gather(self) -> None:
        """Start sending local blocks to their owners."""

    def compute(self) -> None:
        """Wait for the gather, compute the full updates this rank owns."""

    def launch_scatter(self) -> None:
        """Start returning the update blocks to the ranks that hold them."""

    def finish(self) -> None:
        """Wait for the scatter, apply this rank's blocks."""


def run(steps: Sequence[GroupStep], overlap: bool) -> None:
    """Run every micro-group's four phases, pipelined when ``overlap``."""
    if not overlap:
        for step in steps:
            step.launch_gather()
            step.compute()
            step.launch_scatter()
            step.finish()
        return
    if steps:
        steps[0].launch_gather()
    for index, step in enumerate(steps):
        if index + 1 < len(steps):
            steps[index + 1].launch_gather()
        step.compute()
        step.launch_scatter()
        if index > 0:
            steps[index - 1].finish()
    if steps:
        steps[-1].finish()
