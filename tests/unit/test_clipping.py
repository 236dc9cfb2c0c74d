"""Clipping by the norm of every gradient together (`distributed.clipping`), in one process."""

from __future__ import annotations

import pytest
import torch

from lightning_canzona.distributed.clipping import clip_grad_norm_


def _parameters() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((3, 4), (5,), (2, 2))]
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, generator=generator)
    return parameters


def test_clipping_scales_as_torch_does_and_returns_the_norm() -> None:
    ours, theirs = _parameters(), _parameters()
    total = clip_grad_norm_(ours, 0.5)
    assert torch.allclose(total, torch.nn.utils.clip_grad_norm_(theirs, 0.5))
    for mine, reference in zip(ours, theirs):
        assert torch.allclose(mine.grad, reference.grad)


def test_a_non_finite_norm_raises_before_any_gradient_changes() -> None:
    parameters = _parameters()
    parameters[1].grad[2] = float("inf")
    before = [parameter.grad.clone() for parameter in parameters]
    with pytest.raises(RuntimeError, match=r"non-finite \(inf\): nothing was clipped"):
        clip_grad_norm_(parameters, 0.5, error_if_nonfinite=True)
    assert all(torch.equal(p.grad, g) for p, g in zip(parameters, before))
