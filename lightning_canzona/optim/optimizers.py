"""The optimizers users construct: `Muon`, `NorMuon`, `Shampoo` and `SOAP`.

Each is a `torch.optim.Optimizer` holding its matrix groups and AdamW groups together; the
math lives in `lightning_canzona.rules`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

from lightning_canzona.optim.optimizer import (
    MatrixOptimizer,
    check_betas,
    check_non_negative,
    resolve_dtype,
)
from lightning_canzona.qk_clip.settings import QKClip
from lightning_canzona.rules.compiled import check_compile
from lightning_canzona.rules.muon import ADJUST_LR_FNS, MuonRule
from lightning_canzona.rules.newton_schulz import FORMS, Coefficients, resolve_schedule
from lightning_canzona.rules.normuon import NorMuonRule
from lightning_canzona.rules.shampoo import EPSILON_MODES, EpsilonMode, ShampooRule
from lightning_canzona.rules.soap import SOAPRule


def _check_positive_int(**settings: int) -> None:
    for name, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_unit_interval(**settings: float) -> None:
    for name, value in settings.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must lie in [0, 1), got {value!r}")


class Muon(MatrixOptimizer):
    """Muon for weight matrices, AdamW for everything else, in one optimizer.

    Takes ``torch.optim.Muon``'s keywords with its defaults and computes the same update (see
    `lightning_canzona.rules.muon`); 3-D parameters are stacks of matrices (experts),
    each orthogonalised on its own.

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param groups; see
            `lightning_canzona.matrix_param_groups`.
        lr: Learning rate γ.
        weight_decay: Decoupled weight decay λ.
        momentum: Momentum μ.
        nesterov: Orthogonalise the Nesterov look-ahead ``(1 − μ)·G + μ·B`` instead of ``B``.
        ns_coefficients: A preset (``"quintic"``, ``"polar_express"``, ``"newton_schulz"``), one
            ``(a, b, c)`` triple for every step, or a list of triples, one per step (the last repeats).
        eps: Lower clamp of the Frobenius norm that normalises the input of Newton–Schulz.
        ns_steps: Newton–Schulz iterations.
        adjust_lr_fn: ``"original"`` (``√max(1, rows/cols)``) or ``"match_rms_adamw"``
            (``0.2·√max(rows, cols)``); ``None`` means ``"original"``.
        compute_dtype: Dtype of the Newton–Schulz iteration: ``"bfloat16"`` (as ``torch.optim.Muon``),
            ``"float32"`` (IEEE float32 even where TF32 is enabled: `lightning_canzona.rules.ieee`),
            or ``"auto"``: bfloat16 where the parameters' device multiplies it in hardware (CUDA
            GPUs from Ampere on, CPUs with AVX512-BF16 or AMX), float32 elsewhere.
        ns_form: ``"standard"`` (as ``torch.optim.Muon``) or ``"gram"``: the same polynomial
            iterated on ``XXᵀ``, fewer FLOPs for matrices more than about 1.5 times as long as
            wide; ``"standard-symmetric"`` or ``"gram-symmetric"``: either with its symmetric
            products (``XXᵀ`` and its square) computed by blocks, 5/8 of their FLOPs (see
            `lightning_canzona.rules.newton_schulz`).
        compile: Compile Newton–Schulz with ``torch.compile`` (``True``), run it eagerly
            (``False``), or ``"auto"``: compiled on CUDA, eager elsewhere. The same result bit for
            bit either way; compiling costs seconds per matrix shape at the first step (see
            `lightning_canzona.rules.compiled`). A loaded checkpoint keeps this setting, not the
            saved run's.
        qk_clip: Bound the attention logits after each step (MuonClip's QK-clip, Kimi K2): see
            `lightning_canzona.QKClip`; ``None`` leaves the weights as the update made them.
        **kwargs: AdamW-group settings (``adamw_lr``, ``adamw_betas``, ``adamw_eps``,
            ``adamw_weight_decay``), ``check_finite``, ``stochastic_rounding``, and ``plan``
            (a `lightning_canzona.PlanConfig`: how the updates are distributed): see
            `MatrixOptimizer`.
    """

    algorithm = "muon"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: str | Coefficients | Sequence[Coefficients] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        compute_dtype: str = "auto",
        ns_form: str = "standard",
        compile: bool | Literal["auto"] = "auto",
        qk_clip: QKClip | None = None,
        **kwargs: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            compute_dtype=compute_dtype,
            ns_form=ns_form,
            compile=compile,
        )
        self.check_keywords(kwargs)
        super().__init__(params, defaults, **kwargs)
        self.qk_clip = _qk_clip_setting(qk_clip)

    def matrix_rule(self, group: dict[str, Any]) -> MuonRule:
        return MuonRule(**_muon_settings(group))


class NorMuon(MatrixOptimizer):
    """NorMuon (Muon normalised per output neuron) for weight matrices, AdamW for everything else.

    Muon's keywords and defaults, and ``beta2``; see `lightning_canzona.rules.normuon` for the
    update: each row of Muon's orthogonalised update is divided by the root of its running second
    moment, then the update is scaled back to Muon's Frobenius norm, so Muon's learning rates
    carry over.

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param groups; see
            `lightning_canzona.matrix_param_groups`.
        lr: Learning rate γ.
        weight_decay: Decoupled weight decay λ.
        momentum: Momentum μ.
        nesterov: Orthogonalise the Nesterov look-ahead ``(1 − μ)·G + μ·B`` instead of ``B``.
        ns_coefficients: As `Muon`'s.
        eps: Lower clamp of the Frobenius norm that normalises the input of Newton–Schulz.
        ns_steps: Newton–Schulz iterations.
        adjust_lr_fn: As `Muon`'s: ``"original"`` (``None``) or ``"match_rms_adamw"``.
        compute_dtype: Dtype of the Newton–Schulz iteration, as `Muon`'s (the normalisation
            computes in float32).
        ns_form: As `Muon`'s.
        compile: As `Muon`'s.
        beta2: Decay of each output neuron's second moment (dion's ``muon_beta2``).
        qk_clip: As `Muon`'s.
        **kwargs: AdamW-group settings (``adamw_lr``, ``adamw_betas``, ``adamw_eps``,
            ``adamw_weight_decay``), ``check_finite``, ``stochastic_rounding``, and ``plan``
            (a `lightning_canzona.PlanConfig`): see `MatrixOptimizer`.
    """

    algorithm = "normuon"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: str | Coefficients | Sequence[Coefficients] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        compute_dtype: str = "auto",
        ns_form: str = "standard",
        compile: bool | Literal["auto"] = "auto",
        beta2: float = 0.95,
        qk_clip: QKClip | None = None,
        **kwargs: Any,
    ) -> None:
        muon = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
        newton_schulz = dict(
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, ns_form=ns_form, compile=compile
        )
        defaults = dict(
            **muon, **newton_schulz, adjust_lr_fn=adjust_lr_fn, compute_dtype=compute_dtype, beta2=beta2
        )
        self.check_keywords(kwargs)
        super().__init__(params, defaults, **kwargs)
        self.qk_clip = _qk_clip_setting(qk_clip)

    def matrix_rule(self, group: dict[str, Any]) -> NorMuonRule:
        _check_unit_interval(beta2=group["beta2"])
        return NorMuonRule(**_muon_settings(group), beta2=group["beta2"])


def _qk_clip_setting(qk_clip: QKClip | None) -> QKClip | None:
    if qk_clip is not None and not isinstance(qk_clip, QKClip):
        raise TypeError(
            f"qk_clip must be a lightning_canzona.QKClip (QKClip(threshold=100.0)) or None, got {qk_clip!r}"
        )
    return qk_clip


def _device(group: dict[str, Any]) -> torch.device | None:
    """The device of a param group's parameters (``None`` for an empty group)."""
    return group["params"][0].device if group["params"] else None


def _muon_settings(group: dict[str, Any]) -> dict[str, Any]:
    """`MuonRule`'s fields from a Muon or NorMuon param group, checked."""
    _check_positive_int(ns_steps=group["ns_steps"])
    _check_unit_interval(momentum=group["momentum"])
    check_non_negative(eps=group["eps"])
    adjust_lr_fn = group["adjust_lr_fn"] or "original"
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(
            f"Adjust learning rate function {adjust_lr_fn} is not supported: adjust_lr_fn must be one "
            f"of {ADJUST_LR_FNS} or None"
        )
    if group["ns_form"] not in FORMS:
        raise ValueError(f"ns_form must be one of {FORMS}, got {group['ns_form']!r}")
    return dict(
        schedule=resolve_schedule(group["ns_coefficients"]),
        momentum=group["momentum"],
        nesterov=group["nesterov"],
        ns_steps=group["ns_steps"],
        eps=group["eps"],
        adjust_lr_fn=adjust_lr_fn,
        compute_dtype=resolve_dtype(group["compute_dtype"], _device(group)),
        ns_form=group["ns_form"],
        compile=check_compile(group["compile"]),
    )


class Shampoo(MatrixOptimizer):
    """Shampoo with Adam grafting for weight matrices, AdamW for everything else.

    See `lightning_canzona.rules.shampoo` for the update.

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param groups.
        lr: Learning rate γ (on the Adam scale, thanks to grafting).
        betas: ``(β₁, β₂)``: momentum, and the decay of the Kronecker factors and of the grafting
            second moment.
        eps: Adam grafting's ε.
        epsilon: Eigenvalue floor of each factor before its inverse root: see ``epsilon_mode``.
        weight_decay: Decoupled weight decay λ.
        precondition_frequency: Steps between inverse-root refreshes.
        start_preconditioning_step: First step that uses the Shampoo direction (plain grafted Adam
            before it).
        max_precond_dim: Sides longer than this are not preconditioned.
        epsilon_mode: ``"relative"``: ``epsilon`` times the factor's largest eigenvalue is added
            to its eigenvalues (the floor follows the gradients' scale); ``"absolute"``:
            ``epsilon`` itself, ``(L + ε·I)^(-1/4)``, as Meta's Distributed Shampoo (whose
            default ε is 1e-12).
        **kwargs: AdamW-group settings (``adamw_lr``, ``adamw_betas``, ``adamw_eps``,
            ``adamw_weight_decay``), ``check_finite``, ``stochastic_rounding``, and ``plan``
            (a `lightning_canzona.PlanConfig`: how the updates are distributed): see
            `MatrixOptimizer`.
    """

    algorithm = "shampoo"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        epsilon: float = 1e-6,
        weight_decay: float = 0.0,
        precondition_frequency: int = 10,
        start_preconditioning_step: int = 10,
        max_precond_dim: int = 8192,
        epsilon_mode: EpsilonMode = "relative",
        **kwargs: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            epsilon=epsilon,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            max_precond_dim=max_precond_dim,
            epsilon_mode=epsilon_mode,
        )
        self.check_keywords(kwargs)
        super().__init__(params, defaults, **kwargs)

    def matrix_rule(self, group: dict[str, Any]) -> ShampooRule:
        check_betas("betas", group["betas"])
        check_non_negative(eps=group["eps"], epsilon=group["epsilon"])
        _check_positive_int(
            precondition_frequency=group["precondition_frequency"],
            start_preconditioning_step=group["start_preconditioning_step"],
            max_precond_dim=group["max_precond_dim"],
        )
        if group["epsilon_mode"] not in EPSILON_MODES:
            raise ValueError(f"epsilon_mode must be one of {EPSILON_MODES}, got {group['epsilon_mode']!r}")
        return ShampooRule(
            betas=tuple(group["betas"]),
            eps=group["eps"],
            epsilon=group["epsilon"],
            precondition_frequency=group["precondition_frequency"],
            start_preconditioning_step=group["start_preconditioning_step"],
            max_precond_dim=group["max_precond_dim"],
            epsilon_mode=group["epsilon_mode"],
        )


class SOAP(MatrixOptimizer):
    """SOAP (Adam in Shampoo's eigenbasis) for weight matrices, AdamW for everything else.

    See `lightning_canzona.rules.soap` for the update.

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param groups.
        lr: Learning rate γ.
        betas: Adam's ``(β₁, β₂)`` in the rotated coordinates.
        shampoo_beta: Decay of the Kronecker factors; ``None`` takes β₂.
        eps: Adam's ε.
        weight_decay: Decoupled weight decay λ.
        precondition_frequency: Steps between QR refreshes of the eigenbases.
        max_precond_dim: Sides longer than this keep the identity basis.
        weight_decay_order: ``"decay_first"`` (``W ← W·(1 − γλ) − γ·D``, as ``torch.optim.AdamW``)
            or ``"update_first"``: the SOAP authors' ``soap.py``, ``W ← (W − γ·D)·(1 − γλ)``, and no
            decay on the first step, which only starts the preconditioner.
        **kwargs: AdamW-group settings (``adamw_lr``, ``adamw_betas``, ``adamw_eps``,
            ``adamw_weight_decay``), ``check_finite``, ``stochastic_rounding``, and ``plan``
            (a `lightning_canzona.PlanConfig`: how the updates are distributed): see
            `MatrixOptimizer`.
    """

    algorithm = "soap"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10_000,
        weight_decay_order: str = "decay_first",
        **kwargs: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            shampoo_beta=shampoo_beta,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            weight_decay_order=weight_decay_order,
        )
        self.check_keywords(kwargs)
        super().__init__(params, defaults, **kwargs)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """`MatrixOptimizer.step`, then one more step counted in every SOAP group
        (``param_groups[i]["soap_steps"]``, the same on every rank: a step that raises raises on
        every rank): ``weight_decay_order="update_first"`` skips the first step's decay."""
        loss = super().step(closure)
        for group in self.param_groups:
            if group["algorithm"] == self.algorithm:
                group["soap_steps"] = group.get("soap_steps", 0) + 1
        return loss

    def matrix_rule(self, group: dict[str, Any]) -> SOAPRule:
        check_betas("betas", group["betas"])
        check_non_negative(eps=group["eps"])
        if group["shampoo_beta"] is not None:
            _check_unit_interval(shampoo_beta=group["shampoo_beta"])
        _check_positive_int(
            precondition_frequency=group["precondition_frequency"], max_precond_dim=group["max_precond_dim"]
        )
        return SOAPRule(
            betas=tuple(group["betas"]),
            shampoo_beta=group["shampoo_beta"],
            eps=group["eps"],
            precondition_frequency=group["precondition_frequency"],
            max_precond_dim=group["max_precond_dim"],
            weight_decay_order=group["weight_decay_order"],
            first_step=group.get("soap_steps", 0) == 0,
        )
