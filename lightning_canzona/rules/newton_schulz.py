"""Newton–Schulz orthogonalisation: coefficient presets and the batched iteration.

`newton_schulz` approximates the polar factor ``UVᵀ`` of a matrix (or stack) in one of four
`FORMS`; `team_newton_schulz` computes it over a team of ranks, each holding a slice, and
`team_work` counts what that costs each member. docs/optimizers.md (Muon, Teams, Compiled
Newton–Schulz) derives the forms and their FLOPs.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
from torch import Tensor

from lightning_canzona.compat import compile_function
from lightning_canzona.geometry import split_sizes
from lightning_canzona.rules.base import TeamComputation, TeamRows, TeamSum, summed_dtype

Coefficients = tuple[float, float, float]
#: The forms of the iteration (docs/optimizers.md#muon).
FORMS = ("standard", "gram", "standard-symmetric", "gram-symmetric")
#: Row blocks of `symmetric_product`: of its ``k²`` blocks the ``k(k + 1)/2`` on and below the
#: diagonal are computed (docs/benchmarks.md: why four).
SYMMETRIC_BLOCKS = 4
#: Steps before which the Gram form restarts from ``X`` (0-based): after the second, as published.
GRAM_RESTARTS = (2,)


def flops(rows: int, cols: int, ns_steps: int, form: str = "standard") -> float:
    """FLOPs of ``ns_steps`` steps of ``form`` on one ``rows × cols`` matrix: a team of one's."""
    return team_work(rows, cols, ns_steps, form, 1).flops


def working_bytes(short: int, long: int, dtype: torch.dtype) -> int:
    """Bytes of the temporaries of Newton–Schulz on a ``short × long`` matrix (its Gram side ``short``,
    input already in ``dtype``) at their peak, beside its input and its result: two iterates (the
    previous one, and the copy a batched product makes of a transposed one) with the Gram matrix and
    the polynomial (``short²`` each), as the allocator counts them (docs/memory.md)."""
    return (2 * short * long + 2 * short * short) * dtype.itemsize


def symmetric_product(
    x: Tensor,
    added: Tensor | None = None,
    beta: float = 1.0,
    alpha: float = 1.0,
    blocks: int = SYMMETRIC_BLOCKS,
) -> Tensor:
    """``x @ x.mT``, or ``beta·added + alpha·x @ x.mT`` for a symmetric ``added``, by blocks of rows
    on and below the diagonal, the others mirrored."""
    sizes = split_sizes(x.size(-2), min(blocks, x.size(-2)))
    parts = x.split(sizes, dim=-2)
    starts = list(itertools.accumulate(sizes, initial=0))
    product = x.new_empty(*x.shape[:-1], x.size(-2))
    for i, rows in enumerate(parts):
        below = slice(starts[i], starts[i + 1])
        for j in range(i + 1):
            right = slice(starts[j], starts[j + 1])
            if added is None:
                block = rows @ parts[j].mT
            else:
                block = _add_product(added[..., below, right], rows, parts[j].mT, beta, alpha)
            product[..., below, right] = block
            if i != j:
                product[..., right, below] = block.mT
    return product


def _add_product(added: Tensor, left: Tensor, right: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """``beta·added + alpha·left @ right``, fused, for matrices or stacks of them."""
    fused = torch.addmm if left.ndim == 2 else torch.baddbmm
    return fused(added, left, right, beta=beta, alpha=alpha)


def _left_product(left: Tensor, x: Tensor, beta: float | None, transposed: bool) -> Tensor:
    """``beta·x + left·x`` (``left·x`` where ``beta`` is None), transposed where ``transposed``,
    computed so that the result is contiguous in that orientation."""
    if transposed:
        x, left = x.mT, left.mT
        return x @ left if beta is None else _add_product(x, x, left, beta=beta)
    return left @ x if beta is None else _add_product(x, left, x, beta=beta)


def _split_form(form: str) -> tuple[str, bool]:
    """A form's iteration (``"standard"`` or ``"gram"``) and whether its products go by blocks."""
    if form not in FORMS:
        raise ValueError(f"Newton–Schulz form must be one of {FORMS}, got {form!r}")
    return form.removesuffix("-symmetric"), form.endswith("-symmetric")


def _gram(x: Tensor, symmetric: bool) -> Tensor:
    return symmetric_product(x) if symmetric else x @ x.mT


def _polynomial(gram: Tensor, b: float, c: float, symmetric: bool) -> Tensor:
    """``b·A + c·A²`` of a symmetric ``A``."""
    if symmetric:
        return symmetric_product(gram, gram, beta=b, alpha=c)
    return _add_product(gram, gram, gram, beta=b, alpha=c)


def _gram_flops(rows: int, cols: int, symmetric: bool) -> int:
    """FLOPs of ``X Xᵀ`` for a ``rows × cols`` ``X``, whole or by `symmetric_product`'s blocks."""
    if not symmetric:
        return 2 * rows * rows * cols
    sizes = split_sizes(rows, min(SYMMETRIC_BLOCKS, rows))
    return cols * (rows * rows + sum(size * size for size in sizes))


@dataclass(frozen=True)
class NewtonSchulzSchedule:
    """Per-step quintic coefficients and the normalisation that makes them valid.

    Attributes:
        name: Preset name, or ``"custom"``.
        coefficients: ``(a, b, c)`` for step 1, 2, …; the last triple repeats.
        norm_safety: The input is divided by ``norm_safety · ‖X‖_F`` (>= 1).
        design_lower_bound: Smallest normalised singular value the schedule was designed for.
    """

    name: str
    coefficients: tuple[Coefficients, ...]
    norm_safety: float = 1.0
    design_lower_bound: float = 1e-3

    def __post_init__(self) -> None:
        if not self.coefficients:
            raise ValueError(f"Newton–Schulz schedule {self.name!r} has no coefficients")
        for triple in self.coefficients:
            if len(triple) != 3 or not all(math.isfinite(float(value)) for value in triple):
                raise ValueError(
                    f"Newton–Schulz coefficients must be finite (a, b, c) triples, got {triple!r} "
                    f"in schedule {self.name!r}"
                )
        if not self.norm_safety >= 1.0:
            raise ValueError(f"norm_safety must be >= 1, got {self.norm_safety}")

    def steps(self, ns_steps: int) -> list[Coefficients]:
        """The coefficients of each of ``ns_steps`` steps (the last triple repeats)."""
        tail = itertools.repeat(self.coefficients[-1], max(0, ns_steps - len(self.coefficients)))
        return [*self.coefficients[:ns_steps], *tail]

    def singular_value_map(self, sigma: Tensor, ns_steps: int) -> Tensor:
        """Where ``ns_steps`` steps send normalised singular values ``sigma`` (in float64)."""
        x = sigma.to(torch.float64)
        for a, b, c in self.steps(ns_steps):
            x2 = x * x
            x = x * (a + x2 * (b + c * x2))
        return x

    def singular_value_band(
        self, ns_steps: int, lower: float | None = None, samples: int = 200_001
    ) -> tuple[float, float]:
        """``(min, max)`` of the output singular values after ``ns_steps`` for inputs in ``[lower, 1]``
        (default ``design_lower_bound``), on a geometric grid of ``samples`` points."""
        lower = self.design_lower_bound if lower is None else lower
        if not 0.0 < lower <= 1.0:
            raise ValueError(f"lower must lie in (0, 1], got {lower}")
        grid = torch.logspace(math.log10(lower), 0.0, samples, dtype=torch.float64)
        out = self.singular_value_map(grid, ns_steps)
        return float(out.min()), float(out.max())


def _polar_express() -> NewtonSchulzSchedule:
    # Amsel, Persson, Musco & Gower (2025), "The Polar Express", Algorithm 1: minimax-optimal
    # degree-5 polynomials for the interval [1e-3, 1]; every step but the converged last one is
    # deflated by a 1.01 safety factor so that bf16 rounding cannot push values past 1.
    raw = (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    )
    safety = 1.01
    deflated = tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in raw[:-1])
    return NewtonSchulzSchedule("polar_express", (*deflated, raw[-1]), norm_safety=safety)


PRESETS: dict[str, NewtonSchulzSchedule] = {
    # Keller Jordan's quintic, the default of torch.optim.Muon: maximal slope at zero, so small
    # singular values grow fast, at the price of not converging to 1 (it oscillates in ~[0.7, 1.2]).
    "quintic": NewtonSchulzSchedule("quintic", ((3.4445, -4.7750, 2.0315),)),
    "polar_express": _polar_express(),
    # The classical degree-5 Newton–Schulz (Padé) iteration: converges to exactly 1, slowly at first.
    "newton_schulz": NewtonSchulzSchedule("newton_schulz", ((15 / 8, -10 / 8, 3 / 8),)),
}


def resolve_schedule(
    ns_coefficients: str | Coefficients | Sequence[Coefficients] | NewtonSchulzSchedule,
) -> NewtonSchulzSchedule:
    """A schedule from a preset name, one ``(a, b, c)`` triple or a per-step list; `ValueError` if neither."""
    if isinstance(ns_coefficients, NewtonSchulzSchedule):
        return ns_coefficients
    if isinstance(ns_coefficients, str):
        try:
            return PRESETS[ns_coefficients]
        except KeyError:
            raise ValueError(
                f"Unknown ns_coefficients preset {ns_coefficients!r}; choose one of "
                f"{sorted(PRESETS)} or pass (a, b, c) coefficients"
            ) from None
    values = tuple(ns_coefficients)
    if values and all(isinstance(value, (int, float)) for value in values):
        triples: tuple[Coefficients, ...] = (values,)  # type: ignore[assignment]
    else:
        triples = tuple(tuple(triple) for triple in values)  # type: ignore[misc]
    if triples == PRESETS["quintic"].coefficients:
        return PRESETS["quintic"]
    return NewtonSchulzSchedule("custom", triples)


def newton_schulz(
    matrix: Tensor,
    schedule: NewtonSchulzSchedule,
    ns_steps: int,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    form: str = "standard",
    compile: bool = False,
) -> Tensor:
    """Approximate the polar factor of ``matrix`` (or of each matrix in a stack).

    Args:
        matrix: A ``(..., m, n)`` tensor; leading dimensions are a batch.
        schedule: The coefficients per step.
        ns_steps: Number of iterations.
        eps: Lower clamp of the normaliser, so that an all-zero input stays zero.
        dtype: Compute dtype of the iteration.
        form: One of `FORMS`.
        compile: Run the steps compiled; the normalisation stays eager.

    Returns:
        A tensor of ``matrix``'s shape in ``dtype``.
    """
    if matrix.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack of matrices, got {matrix.shape}")
    if ns_steps < 1:
        raise ValueError(f"ns_steps must be >= 1, got {ns_steps}")
    iteration, symmetric = _split_form(form)
    x = matrix.to(dtype)
    # Iterate on the wide orientation: the Gram matrix is then min(m, n)² instead of max(m, n)².
    transposed = matrix.size(-2) > matrix.size(-1)
    if transposed:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    scale = (norm * schedule.norm_safety).clamp_min(eps)
    gram = iteration == "gram"
    if not compile and x.ndim <= 3:
        # The first iterate is made where it is consumed, so that no caller's frame holds it past
        # the first step: one ``m × n`` temporary less at the peak.
        return _steps(x, schedule, ns_steps, gram, symmetric, transposed, scale)
    x = x / scale
    # Stacks run as one batched matmul per product; single matrices keep mm's faster kernels.
    batch_shape = x.shape[:-2]
    if x.ndim > 3:
        x = x.reshape(-1, *x.shape[-2:])
    iterate = compiled(_steps) if compile else _steps
    x = iterate(x, schedule, ns_steps, gram, symmetric, transposed)
    return x.reshape(*batch_shape, *x.shape[-2:])


def _steps(
    x: Tensor,
    schedule: NewtonSchulzSchedule,
    ns_steps: int,
    gram: bool,
    symmetric: bool,
    transposed: bool,
    scale: Tensor | None = None,
) -> Tensor:
    """`newton_schulz`'s steps on the wide ``x``, normalised (or divided by ``scale`` first): what it
    compiles."""
    iterate = _gram_steps if gram else _standard_steps
    return iterate(x, schedule.steps(ns_steps), symmetric, transposed, scale)


@dataclass(frozen=True)
class TeamWork:
    """What `team_newton_schulz` costs each member of a team, for one matrix.

    Attributes:
        flops: The busiest member's FLOPs.
        collectives: Collectives among the members.
        numel: Elements each member sends, in elements of the iteration's dtype.
    """

    flops: float
    collectives: int
    numel: int


def splits_polynomial(rows: int, cols: int, size: int) -> bool:
    """Whether a team splits the standard form's polynomial by rows: when ``2a(k − 1) > b``."""
    a, b = min(rows, cols), max(rows, cols)
    return 2 * a * (size - 1) > b


def team_work(
    rows: int, cols: int, ns_steps: int, form: str, size: int, dtype: torch.dtype = torch.bfloat16
) -> TeamWork:
    """Cost of `team_newton_schulz` in ``dtype`` to each member of a team of ``size``."""
    iteration, symmetric = _split_form(form)
    summed = summed_dtype(dtype)
    norm = 1 if summed != torch.float32 else 0  # a collective of its own
    per_sum, per_norm = summed.itemsize / dtype.itemsize, 4 / dtype.itemsize
    a, b = min(rows, cols), max(rows, cols)
    slice_, share = -(-b // size), (size - 1) / size
    gram, square = _gram_flops(a, slice_, symmetric), _gram_flops(a, a, symmetric)
    if iteration == "gram":
        # Per step R² and P·Q (none on a first step after a (re)start) and R ← P·R·P (none on
        # the last), on every member; per (re)start R = XXᵀ and, at its end, X ← QX, by slices.
        starts = 1 + sum(1 for step in GRAM_RESTARTS if 0 < step < ns_steps)
        flops = (gram + 2 * a * a * slice_) * starts + square * ns_steps + 6 * a**3 * (ns_steps - starts)
        summed_numel = per_norm + per_sum * starts * a * a
        return TeamWork(float(flops), norm + starts, round(2 * share * summed_numel))
    split = splits_polynomial(rows, cols, size)
    polynomial = 2 * a * a * -(-a // size) if split else square
    gathered = share * ns_steps * a * a if split else 0
    return TeamWork(
        float(ns_steps * (gram + 2 * a * a * slice_ + polynomial)),
        norm + ns_steps + (ns_steps if split else 0),
        round(2 * share * (per_norm + per_sum * ns_steps * a * a) + gathered),
    )


def team_newton_schulz(
    matrix: Tensor,
    shape: Sequence[int],
    schedule: NewtonSchulzSchedule,
    ns_steps: int,
    eps: float,
    dtype: torch.dtype,
    member: int,
    size: int,
    form: str = "standard",
) -> TeamComputation:
    """Member ``member``'s slice of `newton_schulz`'s result, computed by a team of ``size``.

    ``matrix`` is this member's slice (columns of a wide matrix, rows of a tall one) of a matrix of
    ``shape``; the other arguments are `newton_schulz`'s. Returns the slice of the result in ``dtype``.
    """
    transposed = shape[-2] > shape[-1]  # iterate on the wide orientation, as `newton_schulz`
    x = matrix.to(dtype)
    if transposed:
        x = x.mT
    batch_shape = x.shape[:-2]
    if x.ndim > 3:
        x = x.reshape(-1, *x.shape[-2:])
    iteration, symmetric = _split_form(form)
    squares = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32).square()
    squares, gram = yield (TeamSum(squares), TeamSum(_gram(x, symmetric)))
    scale = (squares.sqrt().to(dtype) * schedule.norm_safety).clamp_min(eps)
    x, gram = x / scale, gram / (scale * scale)
    steps = schedule.steps(ns_steps)
    if iteration == "gram":
        identity = torch.eye(x.size(-2), dtype=x.dtype, device=x.device)
        accumulated = None
        for step, (a, b, c) in enumerate(steps):
            if step in GRAM_RESTARTS and accumulated is not None:
                x = accumulated @ x
                (gram,), accumulated = (yield (TeamSum(_gram(x, symmetric)),)), None
            polynomial = _polynomial(gram, b, c, symmetric) + a * identity
            accumulated = polynomial if accumulated is None else polynomial @ accumulated
            if step + 1 < len(steps) and step + 1 not in GRAM_RESTARTS:
                gram = polynomial @ gram @ polynomial
        x = _left_product(accumulated, x, None, transposed)
    else:
        rows = split_sizes(x.size(-2), size)
        split = splits_polynomial(shape[-2], shape[-1], size)  # the same on every member
        start = sum(rows[:member])
        mine = slice(start, start + rows[member])
        for step, (a, b, c) in enumerate(steps):
            if step:
                (gram,) = yield (TeamSum(_gram(x, symmetric)),)
            if split:
                part = gram[..., mine, :]
                (polynomial,) = yield (TeamRows(_add_product(part, part, gram, beta=b, alpha=c), rows),)
            else:
                polynomial = _polynomial(gram, b, c, symmetric)
            x = _left_product(polynomial, x, a, transposed and step == len(steps) - 1)
    return x.reshape(*batch_shape, *x.shape[-2:])


def _standard_steps(
    x: Tensor, steps: list[Coefficients], symmetric: bool, transposed: bool, scale: Tensor | None = None
) -> Tensor:
    """The standard form's steps on the wide ``x`` (divided by ``scale`` first, where given); transposed
    back by the last product if ``transposed``."""
    if scale is not None:
        x = x / scale
    for step, (a, b, c) in enumerate(steps):
        polynomial = _polynomial(_gram(x, symmetric), b, c, symmetric)
        x = _left_product(polynomial, x, a, transposed and step == len(steps) - 1)
    return x


def _gram_steps(
    x: Tensor, steps: list[Coefficients], symmetric: bool, transposed: bool, scale: Tensor | None = None
) -> Tensor:
    """The Gram form's steps, as `_standard_steps`."""
    if scale is not None:
        x = x / scale
    identity = torch.eye(x.size(-2), dtype=x.dtype, device=x.device)
    gram, accumulated = _gram(x, symmetric), None
    for step, (a, b, c) in enumerate(steps):
        if step in GRAM_RESTARTS and accumulated is not None:
            x = accumulated @ x
            gram, accumulated = _gram(x, symmetric), None
        polynomial = _polynomial(gram, b, c, symmetric) + a * identity
        accumulated = polynomial if accumulated is None else polynomial @ accumulated
        if step + 1 < len(steps) and step + 1 not in GRAM_RESTARTS:
            gram = polynomial @ gram @ polynomial
    return _left_product(accumulated, x, None, transposed)


# The compile setting: the steps compiled with torch.compile (docs/optimizers.md, Compiled
# Newton–Schulz, says what is compiled, how, and what stays eager and why).

#: The values the ``compile`` setting takes.
COMPILE_CHOICES = (True, False, "auto")
Compile = bool | Literal["auto"]
#: Graphs that the compiled function may hold (one per shape, dtype and form; a stack's count
#: of matrices is part of its shape) before dynamo would stop compiling it (raise, under
#: ``fullgraph=True``).
GRAPHS = 256

Function = TypeVar("Function", bound=Callable[..., object])


def check_compile(value: object) -> Compile:
    """``value`` if it is a ``compile`` setting, else a `ValueError` naming the setting."""
    if value not in COMPILE_CHOICES or not isinstance(value, (bool, str)):
        raise ValueError(f"compile must be True, False or 'auto', got {value!r}")
    return value  # type: ignore[return-value]


def compiles(setting: Compile, device: torch.device) -> bool:
    """Whether ``setting`` compiles the rules' functions for tensors on ``device``: ``"auto"`` on CUDA."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


@functools.cache
def compiled(function: Function) -> Function:
    """``function`` compiled once for the process, one graph per shape, dtype and form."""
    options = {"emulate_precision_casts": True}
    return compile_function(function, GRAPHS, fullgraph=True, dynamic=False, options=options)
