"""Timing of work on a device, for telemetry.

On an accelerator the host returns from a kernel launch long before the kernel ends, so intervals
are marked with timing events on the current stream and read only when asked for (which waits for
them). On CPU the work is done when the call returns, so the host clock is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class Clock:
    """Marks moments of the work issued on ``device`` and measures intervals between them.

    Args:
        device: The device whose work is timed.
    """

    def __init__(self, device: torch.device) -> None:
        self.on_host = device.type == "cpu"
        self.device = device

    def mark(self) -> float | torch.Event:
        """The current moment of the device's work."""
        if self.on_host:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event


@dataclass
class Intervals:
    """A running total of timed intervals; events are read (and waited for) only in `seconds`."""

    _host: float = 0.0
    _events: list[tuple[torch.Event, torch.Event]] = field(default_factory=list)

    def add(self, start: float | torch.Event, end: float | torch.Event) -> None:
        if isinstance(start, float) and isinstance(end, float):
            self._host += end - start
        else:
            self._events.append((start, end))  # type: ignore[arg-type]

    def extend(self, other: Intervals) -> None:
        """Add ``other``'s intervals to these."""
        self._host += other._host
        self._events.extend(other._events)

    @property
    def seconds(self) -> float:
        """Total seconds of the intervals added so far."""
        total = self._host
        for start, end in self._events:
            end.synchronize()
            total += start.elapsed_time(end) / 1000.0
        return total
