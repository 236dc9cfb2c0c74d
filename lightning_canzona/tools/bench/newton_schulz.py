"""Newton–Schulz forms side by side: time, FLOP rate against plain matmul, accuracy.

For each shape and dtype, every form of the iteration (`rules.newton_schulz.FORMS`) and the Gram
matmul ``(a × b) @ (b × a)`` that the standard form is built from are timed interleaved. The rate
of a form is its own FLOP count over its time; the ratio to the matmul's rate is the efficiency of
the implementation (normalisation, scaling, transposes). Each form's result is compared with the
float64 polar factor ``UVᵀ`` of the input (relative Frobenius distance: what the schedule's
approximation and the dtype's rounding leave together) and with the float64 result of the same
iteration (rounding alone). The references are computed on the CPU; the forms run on the
device given (`References` alone is `canzona doctor`'s Newton–Schulz check).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lightning_canzona.rules.newton_schulz import FORMS, PRESETS, flops, newton_schulz
from lightning_canzona.tools.bench.timing import median_seconds
from lightning_canzona.tools.tables import table

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


@dataclass(frozen=True)
class Accuracy:
    """One form's result on one matrix, as relative Frobenius distances."""

    from_polar: float  # from the float64 polar factor: the schedule's approximation and rounding
    from_float64: float  # from the float64 result of the same iteration: rounding alone


class References:
    """A random ``shape`` matrix in float64 on the CPU, its polar factor, and each form's float64
    result (computed once, on first use), for ``ns_steps`` quintic steps."""

    def __init__(self, shape: tuple[int, int], ns_steps: int = 5, seed: int = 0) -> None:
        self.matrix = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        self.ns_steps = ns_steps
        u, _, vh = torch.linalg.svd(self.matrix, full_matrices=False)
        self.polar = u @ vh
        self._in_float64: dict[str, torch.Tensor] = {}

    def in_float64(self, form: str) -> torch.Tensor:
        if form not in self._in_float64:
            self._in_float64[form] = newton_schulz(
                self.matrix, PRESETS["quintic"], self.ns_steps, dtype=torch.float64, form=form
            )
        return self._in_float64[form]

    def run(self, form: str, dtype: torch.dtype, device: torch.device) -> functools.partial[torch.Tensor]:
        """The iteration of ``form`` in ``dtype`` on ``device``, on the matrix there: a call."""
        matrix = self.matrix.to(device=device, dtype=dtype)
        schedule = PRESETS["quintic"]
        return functools.partial(newton_schulz, matrix, schedule, self.ns_steps, dtype=dtype, form=form)

    def accuracy(self, result: torch.Tensor, form: str) -> Accuracy:
        """How far ``result`` (of `run`) lies from the polar factor and from ``form`` in float64."""
        result = result.cpu()
        return Accuracy(_distance(result, self.polar), _distance(result, self.in_float64(form)))


def measure(
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES,
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
    ns_steps: int = 5,
    repeats: int = 7,
    device: torch.device | str = "cpu",
) -> list[FormRow]:
    """Time and check every form for every shape and dtype, on ``device``."""
    rows = []
    device = torch.device(device)
    for seed, shape in enumerate(shapes):
        references = References(shape, ns_steps, seed)
        for dtype in dtypes:
            matrix = references.matrix.to(device=device, dtype=dtype)
            wide = matrix if shape[0] <= shape[1] else matrix.mT.contiguous()
            small, large = wide.shape
            runs = {form: references.run(form, dtype, device) for form in FORMS}
            seconds = median_seconds(
                {**runs, "matmul": functools.partial(torch.matmul, wide, wide.mT)},
                repeats=repeats,
                device=device,
            )
            matmul_gflops = 2 * small * small * large / seconds["matmul"] / 1e9
            for form, run in runs.items():
                accuracy = references.accuracy(run(), form)
                rows.append(
                    FormRow(
                        shape=shape,
                        dtype=str(dtype).removeprefix("torch."),
                        form=form,
                        milliseconds=1e3 * seconds[form],
                        standard_milliseconds=1e3 * seconds["standard"],
                        gflops=flops(*shape, ns_steps, form) / seconds[form] / 1e9,
                        matmul_gflops=matmul_gflops,
                        from_polar=accuracy.from_polar,
                        from_float64=accuracy.from_float64,
                    )
                )
    return rows


def format_table(rows: list[FormRow]) -> str:
    """The rows as a table (`lightning_canzona.tools.tables.table`)."""
    headers = ["shape", "dtype", "form", "ms", "÷ standard", "GFLOP/s", "÷ matmul", "from polar", "from f64"]
    cells = [
        [
            f"{row.shape[0]}x{row.shape[1]}",
            row.dtype,
            row.form,
            f"{row.milliseconds:.2f}",
            f"{row.milliseconds / row.standard_milliseconds:.2f}",
            f"{row.gflops:.1f}",
            f"{row.ratio:.2f}",
            f"{row.from_polar:.2e}",
            f"{row.from_float64:.2e}",
        ]
        for row in rows
    ]
    return table(headers, cells, left=(0, 1, 2), margin=1)
