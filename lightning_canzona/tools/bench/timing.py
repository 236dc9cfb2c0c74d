"""Wall-clock timing for benchmarks: interleaved repeats, reported as medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(
    candidates: dict[str, Callable[[], object]],
    *,
    repeats: int = 7,
    min_seconds: float = 0.05,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in alternation.

    Alternating the candidates within every repeat spreads the machine's noise (other processes,
    frequency changes) evenly over them, so their ratios stay meaningful on a busy machine.
    Each repeat runs a candidate enough times to last ``min_seconds``. On a ``device`` that runs
    kernels asynchronously (CUDA), each timing waits for them to finish.
    """
    wait = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    calls = {}
    for name, run in candidates.items():
        run()  # warm-up: allocator, kernels, lazy initialisation
        wait()
        start, count = time.perf_counter(), 0
        while time.perf_counter() - start < min_seconds:
            run()
            wait()
            count += 1
        calls[name] = count
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, run in candidates.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                run()
            wait()
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(values) for name, values in samples.items()}
