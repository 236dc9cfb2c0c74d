"""NorMuon on one process: the published normalisation, and the whole update written out."""

import math

import pytest
import torch

import lightning_canzona as lc
from lightning_canzona.rules.normuon import normalize_rows


def _dions_normalization(orthogonal, second_moment, beta2):
    """The normalisation of microsoft/dion's NorMuon (``dion/normuon.py``,
    ``_normuon_normalization_core``), from its equations: the rows' mean squares into an EMA, each
    row divided by its root (+ 1e-8), the Frobenius norm restored (its divisor clamped at 1e-8)."""
    second_moment = beta2 * second_moment + (1 - beta2) * (orthogonal * orthogonal).mean(dim=-1, keepdim=True)
    normalized = orthogonal / (torch.sqrt(second_moment) + 1e-8)
    scale = torch.linalg.norm(orthogonal) / max(torch.linalg.norm(normalized), torch.tensor(1e-8))
    return normalized * scale, second_moment


@pytest.mark.parametrize("shape", [(48, 20), (20, 48)])
def test_the_normalization_is_dions_in_float64(shape) -> None:
    ours, theirs = (
        torch.zeros(shape[0], 1, dtype=torch.float64),
        torch.zeros(shape[0], 1, dtype=torch.float64),
    )
    for _ in range(4):
        # Rows of very different sizes, as Newton–Schulz leaves them: what the moment evens out.
        orthogonal = torch.randn(shape, dtype=torch.float64) * torch.logspace(-1, 1, shape[0])[:, None]
        expected, theirs = _dions_normalization(orthogonal, theirs, beta2=0.9)
        actual = normalize_rows(orthogonal, ours, beta2=0.9)
        # Measured: 4.3e-16 at most (lerp and the EMA written out round differently).
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=0)
        torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=0)
    row_norms = actual.norm(dim=1)
    assert row_norms.max() / row_norms.min() < 3  # measured 1.5-2.1; 116-136 before


def _reference_normuon(initial, grads, *, lr, momentum, weight_decay, beta2, coefficients):
    """Muon's momentum and float32 Newton–Schulz, dion's normalisation, Muon's shape scale."""
    weight, buffer = initial.clone(), torch.zeros_like(initial)
    second_moment = torch.zeros(initial.shape[0], 1)
    rows, cols = weight.shape
    for grad in grads:
        buffer = momentum * buffer + (1 - momentum) * grad
        x = (1 - momentum) * grad + momentum * buffer
        x = x.T if rows > cols else x
        x = x / max(float(x.norm()), 1e-7)
        for a, b, c in coefficients:
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if rows > cols else x
        direction, second_moment = _dions_normalization(x, second_moment, beta2)
        weight = weight * (1 - lr * weight_decay) - lr * math.sqrt(max(1, rows / cols)) * direction
    return weight


@pytest.mark.parametrize("shape", [(40, 24), (24, 40)])
def test_normuon_is_muon_normalized_per_neuron(shape) -> None:
    initial, grads = torch.randn(shape), [torch.randn(shape) for _ in range(4)]
    param = torch.nn.Parameter(initial.clone())
    settings = dict(lr=0.02, momentum=0.95, weight_decay=0.1, beta2=0.9)
    optimizer = lc.NorMuon([param], compute_dtype="float32", **settings)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    coefficients = lc.optim.PRESETS["quintic"].steps(5)
    expected = _reference_normuon(initial, grads, coefficients=coefficients, **settings)
    torch.testing.assert_close(param.detach(), expected, rtol=1e-5, atol=1e-6)
    assert optimizer.state[param]["row_second_moment"].shape == (shape[0], 1)
    muon = torch.nn.Parameter(initial.clone())
    plain = lc.Muon([muon], compute_dtype="float32", lr=0.02, momentum=0.95, weight_decay=0.1)
    for grad in grads:
        muon.grad = grad.clone()
        plain.step()
    assert (muon - param).abs().max() > 1e-3  # not Muon's update


def test_normuon_checks_its_settings_when_it_first_steps() -> None:
    param = torch.nn.Parameter(torch.randn(8, 4))
    param.grad = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"beta2 must lie in \[0, 1\)"):
        lc.NorMuon([param], beta2=1.0).step()
    with pytest.raises(
        TypeError, match="NorMuon.. got an unexpected keyword argument 'beta_2'. Did you mean 'beta2'"
    ):
        lc.NorMuon([param], beta_2=0.9)
