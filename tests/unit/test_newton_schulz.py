import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_canzona.rules.newton_schulz import (
    FORMS,
    PRESETS,
    flops,
    newton_schulz,
    resolve_schedule,
    symmetric_product,
)


def _with_singular_values(rows: int, cols: int, singular_values: torch.Tensor) -> torch.Tensor:
    u, _ = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.float64))
    k = singular_values.numel()
    return (u[:, :k] * singular_values) @ v[:, :k].T


def _inputs() -> dict[str, torch.Tensor]:
    return {
        "random wide": torch.randn(96, 160, dtype=torch.float64),
        "random tall": torch.randn(160, 96, dtype=torch.float64),
        "ill-conditioned (cond 1e4)": _with_singular_values(
            80, 120, torch.logspace(0, -4, 80, dtype=torch.float64)
        ),
        "ill-conditioned tall (cond 1e6, clustered)": _with_singular_values(
            150, 60, torch.cat([torch.full((30,), 5.0), torch.logspace(-3, -6, 30)]).double()
        ),
    }


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("ns_steps", [5, 8])
def test_output_singular_values_stay_in_the_promised_band(preset: str, ns_steps: int) -> None:
    schedule = PRESETS[preset]
    for label, matrix in _inputs().items():
        normalised = torch.linalg.svdvals(matrix) / (schedule.norm_safety * torch.linalg.matrix_norm(matrix))
        out = newton_schulz(matrix.float(), schedule, ns_steps, dtype=torch.float32)
        measured = torch.linalg.svdvals(out.double())
        low, high = schedule.singular_value_band(ns_steps, lower=float(normalised.min()))
        assert low - 2e-3 <= float(measured.min()) and float(measured.max()) <= high + 2e-3, (
            f"{preset}, {label}: singular values in [{measured.min():.4f}, {measured.max():.4f}], "
            f"band [{low:.4f}, {high:.4f}]"
        )
        # Each singular value follows the scalar polynomials on its own, not merely the band.
        expected = schedule.singular_value_map(normalised, ns_steps).sort().values
        torch.testing.assert_close(measured.sort().values, expected, atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    "preset, ns_steps, band",
    [("quintic", 5, (0.68, 1.14)), ("polar_express", 5, (0.87, 1.13)), ("newton_schulz", 10, (0.999, 1.001))],
)
def test_presets_promise_a_tight_band_on_well_conditioned_inputs(preset, ns_steps, band) -> None:
    schedule = PRESETS[preset]
    matrix = _with_singular_values(64, 128, torch.linspace(1.0, 0.1, 64, dtype=torch.float64))
    normalised_min = float(torch.linalg.svdvals(matrix).min() / torch.linalg.matrix_norm(matrix))
    low, high = schedule.singular_value_band(ns_steps, lower=normalised_min / schedule.norm_safety)
    assert band[0] <= low and high <= band[1]
    measured = torch.linalg.svdvals(newton_schulz(matrix.float(), schedule, ns_steps, dtype=torch.float32))
    assert band[0] - 1e-3 <= float(measured.min()) and float(measured.max()) <= band[1] + 1e-3


def test_stack_equals_per_matrix_calls() -> None:
    stack = torch.randn(4, 48, 80)
    schedule = PRESETS["polar_express"]
    batched = newton_schulz(stack, schedule, 5, dtype=torch.float32)
    for index in range(stack.shape[0]):
        single = newton_schulz(stack[index], schedule, 5, dtype=torch.float32)
        torch.testing.assert_close(batched[index], single, rtol=1e-5, atol=1e-6)
    tall = torch.randn(3, 70, 20)
    batched = newton_schulz(tall, schedule, 5, dtype=torch.float32)
    torch.testing.assert_close(batched[1], newton_schulz(tall[1], schedule, 5, dtype=torch.float32))


@pytest.mark.parametrize("form", FORMS)
def test_a_tall_result_is_contiguous_and_the_wide_one_transposed(form: str) -> None:
    # The iteration runs on the wide orientation; a tall matrix's last product is computed
    # transposed, so that its update is contiguous (added as a transposed view it is slow).
    tall = torch.randn(2, 96, 24, dtype=torch.float64)
    out = newton_schulz(tall, PRESETS["quintic"], 5, dtype=torch.float64, form=form)
    wide = newton_schulz(tall.mT.contiguous(), PRESETS["quintic"], 5, dtype=torch.float64, form=form)
    assert out.is_contiguous() and out.shape == tall.shape
    torch.testing.assert_close(out, wide.mT, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="ns_steps must be >= 1, got 0"):
        newton_schulz(tall, PRESETS["quintic"], 0)


def test_zero_matrix_stays_zero() -> None:
    out = newton_schulz(torch.zeros(8, 12), PRESETS["quintic"], 5, dtype=torch.float32)
    assert torch.equal(out, torch.zeros(8, 12))


def test_coefficients_forms() -> None:
    assert resolve_schedule("polar_express") is PRESETS["polar_express"]
    assert resolve_schedule((3.4445, -4.7750, 2.0315)) is PRESETS["quintic"]
    custom = resolve_schedule([(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)])
    assert custom.steps(4) == [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5)]
    with pytest.raises(ValueError, match="Unknown ns_coefficients preset 'cubic'.*polar_express"):
        resolve_schedule("cubic")
    with pytest.raises(ValueError, match=r"\(a, b, c\) triples"):
        resolve_schedule([(1.0, 2.0)])


@pytest.mark.parametrize("preset", ["quintic", "polar_express"])
def test_the_gram_form_computes_the_same_polynomial(preset: str) -> None:
    # Both forms apply the same polynomials of XXᵀ to X: equal up to float64 rounding, on wide,
    # tall, square and stacked inputs, and on an ill-conditioned one.
    schedule = PRESETS[preset]
    inputs = {**_inputs(), "square": torch.randn(64, 64, dtype=torch.float64)}
    inputs["stack"] = torch.randn(3, 40, 100, dtype=torch.float64)
    for label, matrix in inputs.items():
        standard = newton_schulz(matrix, schedule, 6, dtype=torch.float64)
        gram = newton_schulz(matrix, schedule, 6, dtype=torch.float64, form="gram")
        assert float((gram - standard).norm() / standard.norm()) < 1e-12, label


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (64, 64)])
def test_the_cost_model_counts_the_flops_each_form_runs(form: str, shape: tuple[int, int]) -> None:
    matrix = torch.randn(shape)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(matrix, PRESETS["quintic"], 5, dtype=torch.float32, form=form)
    assert counter.get_total_flops() == flops(*shape, 5, form)
    # The Gram form pays off on elongated matrices only.
    a, b = min(shape), max(shape)
    assert (flops(*shape, 5, "gram") < flops(*shape, 5)) == (b > 1.5 * a)


@pytest.mark.parametrize("shape", [(7, 5), (3, 9), (1, 4), (2, 5, 6), (64, 200)])
def test_symmetric_product_is_the_product_with_the_transpose(shape: tuple[int, ...]) -> None:
    # Uneven blocks (7 rows in 4), fewer rows than blocks, a stack.
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    product = symmetric_product(x)
    torch.testing.assert_close(product, x @ x.mT)
    assert product.equal(product.mT)


@pytest.mark.parametrize("form", ["standard", "gram"])
def test_symmetric_products_leave_each_form_as_it_was(form: str) -> None:
    # Wide, tall, square, stacked, ill-conditioned: the same iteration, its symmetric products by
    # blocks. In float64 the same result; in float32 the standard form's within 1e-5, the Gram
    # form's (whose R drifts with rounding) within twice its own rounding of the float64 iteration.
    torch.manual_seed(0)
    inputs = {**_inputs(), "square": torch.randn(64, 64), "stack": torch.randn(3, 40, 100)}
    schedule = PRESETS["quintic"]
    for label, matrix in inputs.items():
        exact = newton_schulz(matrix.double(), schedule, 5, dtype=torch.float64, form=form)
        blocked = newton_schulz(matrix.double(), schedule, 5, dtype=torch.float64, form=f"{form}-symmetric")
        assert float((blocked - exact).norm() / exact.norm()) < 1e-12, label
        full, blocked = (
            newton_schulz(matrix.float(), schedule, 5, dtype=torch.float32, form=f).double()
            for f in (form, f"{form}-symmetric")
        )
        if form == "standard":
            assert float((blocked - full).norm() / full.norm()) < 1e-5, label
        else:
            rounding = float((full - exact).norm() / exact.norm())
            assert float((blocked - exact).norm() / exact.norm()) < 2 * rounding + 1e-6, label
    # Four blocks of 128 rows: 5/8 of the Gram matrix's and of its square's FLOPs, 2 of the
    # standard form's 3 products (the FLOP counter test checks these against the products run).
    a, b = 512, 2048
    gram, square, product = 2 * a * a * b, 2 * a**3, 2 * a * a * b
    assert flops(a, b, 5, "standard-symmetric") == 5 * (5 / 8 * gram + product + 5 / 8 * square)


def test_an_unknown_form_is_named() -> None:
    with pytest.raises(ValueError, match=r"form must be one of \('standard', 'gram', .*\), got 'gramm'"):
        newton_schulz(torch.randn(4, 6), PRESETS["quintic"], 5, form="gramm")
