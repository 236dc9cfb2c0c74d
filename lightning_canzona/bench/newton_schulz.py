"""Newton–Schulz throughput against plain matmul on the same shapes and dtype.

The iteration is nothing but matmuls on the wide orientation of the matrix, so its FLOP rate should
approach that of the matmul it is built from: ``(a × b) @ (b × a)``, the Gram product. The ratio of
the two rates is the efficiency of the implementation (normalisation, scaling, transposes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lightning_canzona.bench.timing import median_seconds
from lightning_canzona.rules.muon import MuonRule
from lightning_canzona.rules.newton_schulz import PRESETS, newton_schulz

DEFAULT_SHAPES = ((256, 256), (512, 512), (512, 2048), (2048, 512), (1024, 1024), (1024, 4096), (2048, 2048))


@dataclass(frozen=True)
class ThroughputRow:
    """One shape and dtype: rates in GFLOP/s."""

    shape: tuple[int, int]
    dtype: str
    newton_schulz_ms: float
    newton_schulz_gflops: float
    matmul_gflops: float

    @property
    def ratio(self) -> float:
        return self.newton_schulz_gflops / self.matmul_gflops


def measure(
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES,
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
    ns_steps: int = 5,
    repeats: int = 7,
) -> list[ThroughputRow]:
    """Time Newton–Schulz and the Gram matmul for every shape and dtype."""
    rows = []
    schedule = PRESETS["quintic"]
    for dtype in dtypes:
        for shape in shapes:
            matrix = torch.randn(shape, dtype=dtype)
            wide = matrix if shape[0] <= shape[1] else matrix.mT.contiguous()
            small, large = wide.shape
            seconds = median_seconds(
                {
                    "ns": functools.partial(newton_schulz, matrix, schedule, ns_steps, dtype=dtype),
                    "matmul": functools.partial(torch.matmul, wide, wide.mT),
                },
                repeats=repeats,
            )
            rule = MuonRule(schedule=schedule, ns_steps=ns_steps)
            ns_flops = rule.cost(shape).flops
            rows.append(
                ThroughputRow(
                    shape=shape,
                    dtype=str(dtype).removeprefix("torch."),
                    newton_schulz_ms=1e3 * seconds["ns"],
                    newton_schulz_gflops=ns_flops / seconds["ns"] / 1e9,
                    matmul_gflops=2 * small * small * large / seconds["matmul"] / 1e9,
                )
            )
    return rows


def format_table(rows: list[ThroughputRow]) -> str:
    """A plain-text table of the rows."""
    lines = [
        f"{'shape':>11} {'dtype':>9} {'NS ms':>9} {'NS GFLOP/s':>11} {'matmul GFLOP/s':>15} {'ratio':>6}"
    ]
    for row in rows:
        shape = f"{row.shape[0]}x{row.shape[1]}"
        lines.append(
            f"{shape:>11} {row.dtype:>9} {row.newton_schulz_ms:9.2f} {row.newton_schulz_gflops:11.1f} "
            f"{row.matmul_gflops:15.1f} {row.ratio:6.2f}"
        )
    return "\n".join(lines)
