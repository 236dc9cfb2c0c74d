"""Newton–Schulz orthogonalisation: coefficient presets and the batched iteration.

Each step applies the odd quintic ``p(X) = a·X + b·(XXᵀ)X + c·(XXᵀ)²X``, which maps every singular
value ``σ`` of ``X`` to ``p(σ) = aσ + bσ³ + cσ⁵`` and leaves the singular vectors alone. After the
input is scaled so that its singular values lie in ``(0, 1]``, a few steps push them towards 1, so
the result approximates the polar factor ``UVᵀ`` of ``X = UΣVᵀ``.

Two forms compute the same polynomial of ``X`` (`FORMS`):

- ``"standard"``: each step forms the ``a × a`` Gram matrix (``2a²b`` FLOPs, ``a = min(m, n)``,
  ``b = max(m, n)``), its square (``2a³``) and the product with ``X`` (``2a²b``): ``k·(4a²b + 2a³)``
  for ``k`` steps.
- ``"gram"`` (Gram Newton–Schulz, Dao AI Lab 2026): every step's polynomial ``P`` is a polynomial of
  ``R = XXᵀ``, so the iteration runs on ``R`` alone — ``P = aI + bR + cR²``, ``R ← PRP``, the
  products ``Q ← PQ`` accumulated — and touches ``X`` only to form ``R`` and, at the end,
  ``X ← QX``: ``4a²b`` per (re)start plus at most ``8a³`` per step (`flops`), fewer FLOPs than the
  standard form once ``b`` exceeds about ``1.5a``. In low precision ``R`` drifts from ``XXᵀ``
  (spurious negative eigenvalues, eigenvectors that wander); restarting — ``X ← QX``,
  ``R ← XXᵀ``, ``Q ← I`` — after the second step, as published, keeps it stable, with bf16
  rounding 2–3 times the standard form's (``canzona bench ns``).

Either form may compute its symmetric products — ``XXᵀ`` and ``R²`` (``R`` is symmetric) — by
blocks of rows, only those on and below the diagonal, the rest mirrored (``"standard-symmetric"``,
``"gram-symmetric"``; `symmetric_product`): with ``k = 4`` blocks ``(k + 1)/2k = 5/8`` of their
FLOPs, the same result bit for bit where the blocks' dot products add up as the whole product's.
In the standard form that is 2 of its 3 products per step.

A team of ranks can run any form on one matrix together (`team_newton_schulz`): each member
holds a slice of the wide orientation's columns, ``X = [X₁ … X_k]``, and the Gram matrix is the
sum of the members' ``XⱼXⱼᵀ`` (an all-reduce of ``a²`` elements, in float32 for bf16:
`rules.base.summed_dtype`). In the standard form each step
sums it, every member forms the polynomial ``P = bA + cA²`` (or its ``1/k`` of the rows, gathered
after, where the ``2a³`` would weigh: `splits_polynomial`), and updates its slice,
``Xⱼ ← aXⱼ + PXⱼ``. The Gram form sums it once per (re)start and otherwise works on ``a × a``
matrices on every member: two collectives in all. The result differs from the single-rank
iteration's only in the order in which partial sums are added; `team_work` counts each member's
FLOPs and collectives.
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
#: The forms of the iteration (see the module docstring).
FORMS = ("standard", "gram", "standard-symmetric", "gram-symmetric")
#: Row blocks of `symmetric_product`: of its ``k²`` blocks the ``k(k + 1)/2`` on and below the
#: diagonal are computed. Measured here (bf16, one thread, 512 × 2048 to 2048 × 2048): 0.65–0.72
#: of the full product's time, against 0.76–0.80 with 2 blocks.
SYMMETRIC_BLOCKS = 4
#: Steps before which the Gram form restarts from ``X`` (0-based): after the second, as published.
GRAM_RESTARTS = (2,)


def flops(rows: int, cols: int, ns_steps: int, form: str = "standard") -> float:
    """FLOPs of ``ns_steps`` steps of ``form`` on one ``rows × cols`` matrix: a team of one's."""
    return team_work(rows, cols, ns_steps, form, 1).flops


def symmetric_product(
    x: Tensor,
    added: Tensor | None = None,
    beta: float = 1.0,
    alpha: float = 1.0,
    blocks: int = SYMMETRIC_BLOCKS,
) -> Tensor:
    """``x @ x.mT`` (of a matrix or of each of a stack), or ``beta·added + alpha·x @ x.mT`` for a
    symmetric ``added`` as one fused product per block, computing only the blocks of rows on and
    below the diagonal and mirroring the others."""
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
    """``beta·x + left·x`` (``left·x`` where ``beta`` is None), or its transpose where
    ``transposed``, computed as ``β·xᵀ + xᵀ·leftᵀ``: a result contiguous in the orientation it is
    returned in. (Added as a transposed view, a tall direction took 3.5 ms against 0.2 for 2²⁰
    contiguous elements on a CPU.)"""
    if transposed:
        x, left = x.mT, left.mT
        return x @ left if beta is None else _add_product(x, x, left, beta=beta)
    return left @ x if beta is None else _add_product(x, left, x, beta=beta)


def _split_form(form: str) -> tuple[str, bool]:
    """A form's iteration (``"standard"`` or ``"gram"``) and whether its symmetric products are
    computed by blocks."""
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
    """FLOPs of ``X Xᵀ`` for a ``rows × cols`` ``X``: ``2·rows²·cols``, or by `symmetric_product`'s
    blocks ``rᵢ`` (``Σ_{i≥j} 2rᵢrⱼ = rows² + Σrᵢ²``) ``cols·(rows² + Σrᵢ²)``."""
    if not symmetric:
        return 2 * rows * rows * cols
    sizes = split_sizes(rows, min(SYMMETRIC_BLOCKS, rows))
    return cols * (rows * rows + sum(size * size for size in sizes))


@dataclass(frozen=True)
class NewtonSchulzSchedule:
    """Per-step quintic coefficients and the normalisation that makes them valid.

    Attributes:
        name: Preset name, or ``"custom"``.
        coefficients: ``(a, b, c)`` for step 1, 2, …; the last triple repeats for further steps.
        norm_safety: The input is divided by ``norm_safety · ‖X‖_F``. A factor above 1 keeps
            singular values below 1 despite rounding, which schedules tuned to the interval
            ``(0, 1]`` rely on.
        design_lower_bound: Smallest normalised singular value the schedule was designed for; the
            band it promises (`singular_value_band`) is for inputs at or above it.
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
        """The interval that output singular values lie in, for inputs in ``[lower, 1]``.

        Every singular value evolves independently through the same scalar polynomials, so the
        band is the range of their composition over the input interval, evaluated on a dense
        geometric grid (the composition is smooth, and the grid includes both end points).

        Args:
            ns_steps: Number of iterations.
            lower: Smallest normalised input singular value; defaults to ``design_lower_bound``.
            samples: Grid size.

        Returns:
            ``(min, max)`` of the output singular values.
        """
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
    """Turn a preset name, one ``(a, b, c)`` triple or a per-step list into a schedule.

    Raises:
        ValueError: For an unknown preset name or malformed coefficients.
    """
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
        matrix: A ``(..., m, n)`` tensor; leading dimensions are a batch, each matrix is
            orthogonalised on its own in the same batched matmuls.
        schedule: The coefficients per step.
        ns_steps: Number of iterations.
        eps: Lower clamp of the normaliser, so that an all-zero input stays zero.
        dtype: Compute dtype of the iteration.
        form: One of `FORMS` (see the module docstring).
        compile: Run the steps compiled (`lightning_canzona.rules.newton_schulz`); the normalisation
            stays eager, its reduction summed in eager's order.

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
    x = x / (norm * schedule.norm_safety).clamp_min(eps)
    # Stacks run as one batched matmul per product; single matrices keep mm's faster kernels.
    batch_shape = x.shape[:-2]
    if x.ndim > 3:
        x = x.reshape(-1, *x.shape[-2:])
    iterate = compiled(_steps) if compile else _steps
    x = iterate(x, schedule, ns_steps, iteration == "gram", symmetric, transposed)
    return x.reshape(*batch_shape, *x.shape[-2:])


def _steps(
    x: Tensor, schedule: NewtonSchulzSchedule, ns_steps: int, gram: bool, symmetric: bool, transposed: bool
) -> Tensor:
    """`newton_schulz`'s steps on the normalised wide orientation ``x``: what it compiles (the
    coefficients, read from ``schedule`` here, are the graph's constants)."""
    iterate = _gram_steps if gram else _standard_steps
    return iterate(x, schedule.steps(ns_steps), symmetric, transposed)


@dataclass(frozen=True)
class TeamWork:
    """What `team_newton_schulz` costs each member of a team, for one matrix.

    Attributes:
        flops: The busiest member's FLOPs.
        collectives: Collectives among the members.
        numel: Elements each member sends to the others (ring all-reduce and all-gather), in
            elements of the iteration's dtype (`rules.base.UpdateCost.team_numel`).
    """

    flops: float
    collectives: int
    numel: int


def splits_polynomial(rows: int, cols: int, size: int) -> bool:
    """Whether a team computes the standard form's polynomial by rows (one more collective per
    step) rather than each member all of it: when the whole ``2a³`` would add more than a quarter
    to a member's ``4a²b/k`` of products with ``X``, i.e. when ``2a(k − 1) > b``."""
    a, b = min(rows, cols), max(rows, cols)
    return 2 * a * (size - 1) > b


def team_work(
    rows: int, cols: int, ns_steps: int, form: str, size: int, dtype: torch.dtype = torch.bfloat16
) -> TeamWork:
    """Cost of `team_newton_schulz` in ``dtype`` to each member of a team of ``size`` on one
    ``rows × cols`` matrix.

    The Gram matrices are summed in `summed_dtype` (float32 for bf16): each of their elements
    counts as many elements of ``dtype`` as it has bytes for; the first round's float32 norm
    travels with them, or apart beside a float64 Gram matrix. Gathered rows travel in ``dtype``.
    """
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

    The first round sums the squared norm and the Gram matrix of the unnormalised slices
    (``XXᵀ/‖X‖²`` is the normalised one's). The standard form then sums each later step's Gram
    matrix, and gathers the polynomial's rows where `splits_polynomial`; the Gram form sums the
    Gram matrix again only when it restarts, and iterates on it alone in between, on every member.

    Args:
        matrix: This member's slice of the matrix (or of each matrix of a stack): columns of a
            wide matrix, rows of a tall one (`lightning_canzona.geometry.member_blocks`).
        shape: The whole matrix's shape.
        schedule: The coefficients per step.
        ns_steps: Number of iterations.
        eps: Lower clamp of the normaliser.
        dtype: Compute dtype of the iteration.
        member: This member's index in the team.
        size: Members in the team.
        form: One of `FORMS` (see the module docstring).

    Returns:
        This member's slice of the result, in ``dtype``.
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


def _standard_steps(x: Tensor, steps: list[Coefficients], symmetric: bool, transposed: bool) -> Tensor:
    """The standard form's steps on the wide orientation ``x``; the result transposed back to
    the matrix's own orientation where ``transposed`` (by the last product)."""
    for step, (a, b, c) in enumerate(steps):
        polynomial = _polynomial(_gram(x, symmetric), b, c, symmetric)
        x = _left_product(polynomial, x, a, transposed and step == len(steps) - 1)
    return x


def _gram_steps(x: Tensor, steps: list[Coefficients], symmetric: bool, transposed: bool) -> Tensor:
    """The Gram form's steps, as `_standard_steps`."""
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
    """Whether ``setting`` compiles the rules' functions for tensors on ``device``: ``"auto"``
    on CUDA only (see the module docstring)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


@functools.cache
def compiled(function: Function) -> Function:
    """``function`` compiled once for the process (see the module docstring for how)."""
    options = {"emulate_precision_casts": True}
    return compile_function(function, GRAPHS, fullgraph=True, dynamic=False, options=options)
