"""Newton–Schulz forms side by side: time, FLOP rate against plain matmul, accuracy.

For each shape and dtype, every form of the iteration (`rules.newton_schulz.FORMS`) and the Gram
matmul ``(a × b) @ (b × a)`` that the standard form is built from are timed interleaved. The rate
of a form is its own FLOP count over its time; the ratio to the matmul's rate is the efficiency of
the implementation (normalisation, scaling, transposes). Each form's result is compared with the
float64 polar factor ``UVᵀ`` of the input (relative Frobenius distance: what the schedule's
approximation and the dtype's rounding leave together) and with the float64 result of the same
iteration (rounding alone).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lightning_canzona.bench.timing import median_seconds
from lightning_canzona.rules.newton_schulz import FORMS, PRESETS, flops, newton_schulz

DEFAULT_SHAPES = ((256, 256), (512, 512), (512, 2048), (2048, 512), (1024, 1024), (1024, 4096), (2048, 2048))


@dataclass(frozen=True)
class FormRow:
    """One shape, dtype and form: time, rates in GFLOP/s, and distances from float64 results."""

    shape: tuple[int, int]
    dtype: str
    form: str
    milliseconds: float
    standard_milliseconds: float
    gflops: float
    matmul_gflops: float
    from_polar: float
    from_float64: float

    @property
    def ratio(self) -> float:
        return self.gflops / self.matmul_gflops


def _distance(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.norm(result.double() - reference) / torch.linalg.norm(reference))


def measure(
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES,
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
    ns_steps: int = 5,
    repeats: int = 7,
) -> list[FormRow]:
    """Time and check every form for every shape and dtype."""
    rows = []
    schedule = PRESETS["quintic"]
    generator = torch.Generator().manual_seed(0)
    for shape in shapes:
        exact = torch.randn(shape, dtype=torch.float64, generator=generator)
        u, _, vh = torch.linalg.svd(exact, full_matrices=False)
        polar = u @ vh
        in_float64 = {
            form: newton_schulz(exact, schedule, ns_steps, dtype=torch.float64, form=form) for form in FORMS
        }
        for dtype in dtypes:
            matrix = exact.to(dtype)
            wide = matrix if shape[0] <= shape[1] else matrix.mT.contiguous()
            small, large = wide.shape
            runs = {
                form: functools.partial(newton_schulz, matrix, schedule, ns_steps, dtype=dtype, form=form)
                for form in FORMS
            }
            seconds = median_seconds(
                {**runs, "matmul": functools.partial(torch.matmul, wide, wide.mT)}, repeats=repeats
            )
            matmul_gflops = 2 * small * small * large / seconds["matmul"] / 1e9
            for form, run in runs.items():
                result = run()
                rows.append(
                    FormRow(
                        shape=shape,
                        dtype=str(dtype).removeprefix("torch."),
                        form=form,
                        milliseconds=1e3 * seconds[form],
                        standard_milliseconds=1e3 * seconds["standard"],
                        gflops=flops(*shape, ns_steps, form) / seconds[form] / 1e9,
                        matmul_gflops=matmul_gflops,
                        from_polar=_distance(result, polar),
                        from_float64=_distance(result, in_float64[form]),
                    )
                )
    return rows


def format_table(rows: list[FormRow]) -> str:
    """A plain-text table of the rows."""
    lines = [
        f"{'shape':>11} {'dtype':>9} {'form':>18} {'ms':>9} {'÷ standard':>10} {'GFLOP/s':>8} "
        f"{'÷ matmul':>8} {'from polar':>10} {'from f64':>9}"
    ]
    for row in rows:
        shape = f"{row.shape[0]}x{row.shape[1]}"
        lines.append(
            f"{shape:>11} {row.dtype:>9} {row.form:>18} {row.milliseconds:9.2f} "
            f"{row.milliseconds / row.standard_milliseconds:10.2f} {row.gflops:8.1f} {row.ratio:8.2f} "
            f"{row.from_polar:10.2e} {row.from_float64:9.2e}"
        )
    return "\n".join(lines)
