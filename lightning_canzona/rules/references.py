"""Shampoo and SOAP written out from their papers' equations: what the tests and ``canzona doctor``
check the rules against. Nothing is shared with the rules; in float64 they give the exact results."""

from __future__ import annotations

import torch
from torch import Tensor


def reference_shampoo(
    initial: Tensor,
    grads: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    epsilon: float,
    start: int,
    frequency: int,
    max_dim: int,
    ridge: bool = False,
) -> Tensor:
    """Shampoo with Adam grafting by explicit ``eigh``, eigenvalues floored relative to the largest
    (or ``ridge``: ``eigh(F + εI)``). Returns the weight after the steps of ``grads``."""

    def eye(size: int) -> Tensor:
        return torch.eye(size, dtype=initial.dtype, device=initial.device)

    def inverse_root(factor: Tensor) -> Tensor:
        if ridge:
            values, vectors = torch.linalg.eigh(factor + epsilon * eye(len(factor)))
        else:
            values, vectors = torch.linalg.eigh(factor)
            values = values.clamp_min(0) + epsilon * values.max()
        return vectors @ torch.diag(values**-0.25) @ vectors.T

    beta1, beta2 = betas
    rows, cols = initial.shape
    weight, m, v = initial.clone(), torch.zeros_like(initial), torch.zeros_like(initial)
    left, right = initial.new_zeros(rows, rows), initial.new_zeros(cols, cols)
    left_root, right_root = eye(rows), eye(cols)
    for t, g in enumerate(grads, start=1):
        left = beta2 * left + (1 - beta2) * g @ g.T
        right = beta2 * right + (1 - beta2) * g.T @ g
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        adam = m_hat / ((v / (1 - beta2**t)).sqrt() + eps)
        if t >= start:
            if (t - start) % frequency == 0:
                left_root = inverse_root(left) if rows <= max_dim else eye(rows)
                right_root = inverse_root(right) if cols <= max_dim else eye(cols)
            direction = left_root @ m_hat @ right_root
            direction = direction * adam.norm() / direction.norm()
        else:
            direction = adam
        weight = weight - lr * direction
    return weight


def reference_soap(
    initial: Tensor,
    grads: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    frequency: int,
) -> tuple[Tensor, list[Tensor]]:
    """SOAP (Vyas et al., 2024, Algorithm 3) in the order of the authors' code. Returns the weight
    and the left basis after each step. Compare rank-deficient factors in the rule's dtype: ``eigh``'s
    choice of null-space eigenvectors is arbitrary."""

    def eigenvectors_descending(factor: Tensor) -> Tensor:
        return torch.linalg.eigh(factor).eigenvectors.flip(-1)

    def rotate(x: Tensor, q_left: Tensor, q_right: Tensor) -> Tensor:
        # Qᵀ_L·X·Q_R, the long side (the columns of a square matrix) turned first, as the
        # optimizer does, so that both round alike.
        return q_left.T @ (x @ q_right) if x.shape[1] >= x.shape[0] else (q_left.T @ x) @ q_right

    beta1, beta2 = betas
    weight = initial.clone()
    m, v = torch.zeros_like(initial), torch.zeros_like(initial)
    left = initial.new_zeros(initial.shape[0], initial.shape[0])
    right = initial.new_zeros(initial.shape[1], initial.shape[1])
    bases: list[Tensor] = []
    q_left = q_right = left  # set by the first step
    for step, g in enumerate(grads, start=1):
        weight = weight * (1 - lr * weight_decay)
        t = step - 1  # Adam's step
        if t > 0:
            g_rotated = rotate(g, q_left, q_right)
            m = beta1 * m + (1 - beta1) * g
            m_rotated = rotate(m, q_left, q_right)
            v = beta2 * v + (1 - beta2) * g_rotated**2
            correction = (1 - beta2**t) ** 0.5 / (1 - beta1**t)
            weight = weight - lr * q_left @ (correction * m_rotated / (v.sqrt() + eps)) @ q_right.T
        # Written as lerp, the EMA rounds like the optimizer's.
        left = left.lerp(g @ g.T, 1 - beta2)
        right = right.lerp(g.T @ g, 1 - beta2)
        if t == 0:
            q_left, q_right = eigenvectors_descending(left), eigenvectors_descending(right)
        elif t % frequency == 0:
            # Sort the columns by the estimated eigenvalues (and V's axes with them), then one
            # step of power iteration followed by QR.
            order_left = torch.diag(q_left.T @ left @ q_left).argsort(descending=True)
            order_right = torch.diag(q_right.T @ right @ q_right).argsort(descending=True)
            q_left, q_right = q_left[:, order_left], q_right[:, order_right]
            v = v[order_left][:, order_right]
            q_left = torch.linalg.qr(left @ q_left).Q
            q_right = torch.linalg.qr(right @ q_right).Q
        bases.append(q_left)
    return weight, bases
