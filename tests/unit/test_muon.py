import math

import pytest
import torch

import lightning_canzona as lc

SHAPES = [(64, 96), (96, 64), (128, 128), (200, 50), (33, 7)]


def _run(optimizer_class, shape, steps=3, grads=None, **kwargs):
    initial = torch.randn(shape)
    param = torch.nn.Parameter(initial.clone())
    optimizer = optimizer_class([param], **kwargs)
    for step in range(steps):
        param.grad = grads[step].clone()
        optimizer.step()
    return initial, param.detach()


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.02},
        {"lr": 0.05, "momentum": 0.9, "nesterov": False, "weight_decay": 0.0},
        {"lr": 0.01, "adjust_lr_fn": "match_rms_adamw", "ns_steps": 6, "eps": 1e-6},
    ],
)
def test_equals_torch_optim_muon_bit_for_bit_in_bf16(shape, kwargs) -> None:
    grads = [torch.randn(shape) for _ in range(3)]
    torch.manual_seed(1)
    initial, ours = _run(lc.Muon, shape, grads=grads, compute_dtype="bfloat16", **kwargs)
    torch.manual_seed(1)
    _, theirs = _run(torch.optim.Muon, shape, grads=grads, **kwargs)
    # The same operations in the same order and dtypes, so the same bits.
    assert torch.equal(ours, theirs)


def _reference_muon_float32(initial, grads, *, lr, momentum, weight_decay, ns_steps, eps, coefficients):
    """torch.optim.Muon's equations, written out, in float32."""
    weight = initial.clone()
    buffer = torch.zeros_like(weight)
    rows, cols = weight.shape
    for grad in grads:
        buffer = momentum * buffer + (1 - momentum) * grad
        x = (1 - momentum) * grad + momentum * buffer
        x = x.T if rows > cols else x
        x = x / max(float(x.norm()), eps)
        for a, b, c in coefficients:
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if rows > cols else x
        weight = weight * (1 - lr * weight_decay) - lr * math.sqrt(max(1, rows / cols)) * x
    return weight


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preset", ["quintic", "polar_express"])
def test_float32_mode_matches_a_float32_reference_tightly(shape, preset) -> None:
    grads = [torch.randn(shape) for _ in range(3)]
    settings = dict(lr=0.02, momentum=0.95, weight_decay=0.1, ns_steps=5, eps=1e-7)
    initial, ours = _run(
        lc.Muon, shape, grads=grads, ns_coefficients=preset, compute_dtype="float32", **settings
    )
    schedule = lc.optim.PRESETS[preset]
    assert schedule.norm_safety in (1.0, 1.01)
    # Polar Express divides by 1.01·‖X‖; fold that into the reference's first polynomial.
    coefficients = schedule.steps(5)
    s = schedule.norm_safety
    a, b, c = coefficients[0]
    coefficients[0] = (a / s, b / s**3, c / s**5)
    expected = _reference_muon_float32(initial, grads, coefficients=coefficients, **settings)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_stack_of_matrices_updates_each_matrix_like_its_own_parameter() -> None:
    stack_shape = (4, 24, 40)
    grads = [torch.randn(stack_shape) for _ in range(3)]
    initial, stacked = _run(lc.Muon, stack_shape, grads=grads, lr=0.02, compute_dtype="float32")
    for index in range(stack_shape[0]):
        single = torch.nn.Parameter(initial[index].clone())
        optimizer = lc.Muon([single], lr=0.02, compute_dtype="float32")
        for grad in grads:
            single.grad = grad[index].clone()
            optimizer.step()
        torch.testing.assert_close(stacked[index], single.detach(), rtol=1e-5, atol=1e-6)


def test_bf16_and_float32_compute_the_same_update_to_rounding() -> None:
    grads = [torch.randn(64, 96)]
    torch.manual_seed(3)
    initial, bf16 = _run(lc.Muon, (64, 96), steps=1, grads=grads, lr=0.02, compute_dtype="bfloat16")
    torch.manual_seed(3)
    _, fp32 = _run(lc.Muon, (64, 96), steps=1, grads=grads, lr=0.02, compute_dtype="float32")
    error = _relative_error(bf16 - initial, fp32 - initial)
    assert 1e-5 < error < 0.1  # different rounding, same update


@pytest.mark.parametrize("bf16_instructions", [True, False])
def test_auto_computes_in_bf16_where_the_cpu_multiplies_it_and_float32_elsewhere(
    bf16_instructions, monkeypatch
) -> None:
    from lightning_canzona.rules import muon as base

    monkeypatch.setattr(base, "cpu_multiplies_bfloat16", lambda: bf16_instructions)
    muon = lc.Muon([torch.nn.Parameter(torch.randn(8, 4))])
    assert muon.param_groups[0]["compute_dtype"] == "auto"  # resolved where the parameters are
    expected = torch.bfloat16 if bf16_instructions else torch.float32
    assert muon.rule_of(muon.param_groups[0]).compute_dtype == expected
    assert base.resolve_dtype("auto", torch.device("meta")) == torch.bfloat16  # as torch.optim.Muon


def test_the_gram_form_updates_as_the_standard_form() -> None:
    # The same polynomial iterated another way: computed in float64, the directions agree to
    # 1e-14 and the float32 weights to their rounding; the planner sees the form's own FLOPs
    # (fewer on a matrix 3× as long as wide).
    grads = [torch.randn(32, 96) for _ in range(3)]
    runs = {}
    for form in ("standard", "gram"):
        torch.manual_seed(5)
        runs[form] = _run(lc.Muon, (32, 96), grads=grads, lr=0.02, compute_dtype="float64", ns_form=form)
    (initial, standard), (_, gram) = runs["standard"], runs["gram"]
    assert _relative_error(gram - initial, standard - initial) < 1e-6
    costs = {
        form: lc.Muon([torch.nn.Parameter(torch.zeros(32, 96))], ns_form=form)
        for form in ("standard", "gram")
    }
    flops = {form: opt.rule_of(opt.param_groups[0]).cost((32, 96)).flops for form, opt in costs.items()}
    assert flops["gram"] < flops["standard"]
    with pytest.raises(ValueError, match=r"ns_form must be one of \('standard', 'gram', .*\), got 'fast'"):
        lc.Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_form="fast").step()
