"""The optimizers users construct: `Muon`, `NorMuon`, `Shampoo` and `SOAP`; their math is their rule's."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from lightning_canzona.optim.optimizer import MatrixOptimizer
from lightning_canzona.qk_clip.settings import QKClip
from lightning_canzona.rules.muon import MuonRule
from lightning_canzona.rules.newton_schulz import Coefficients
from lightning_canzona.rules.normuon import NorMuonRule
from lightning_canzona.rules.shampoo import EpsilonMode, ShampooRule
from lightning_canzona.rules.soap import SOAPRule


def _defaults(optimizer: MatrixOptimizer, arguments: dict[str, Any]) -> dict[str, Any]:
    """The matrix groups' defaults from an ``__init__``'s ``locals()`` (a variant's own from ``kwargs``)."""
    kwargs = arguments["kwargs"]
    optimizer.check_keywords(kwargs)
    names = ["lr", "weight_decay", *optimizer.rule.settings()]
    defaults = {name: value for name, value in arguments.items() if name in names}
    defaults.update((name, kwargs.pop(name)) for name in names if name not in defaults)
    if "betas" in defaults:  # kept as a tuple, whatever sequence was given
        defaults["betas"] = tuple(defaults["betas"])
    return defaults


class Muon(MatrixOptimizer):
    """Muon for weight matrices, AdamW for everything else: ``torch.optim.Muon``'s keywords and update.

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param groups (`lightning_canzona.matrix_param_groups`).
        lr: Learning rate γ.
        weight_decay: Decoupled weight decay λ.
        momentum: Momentum μ.
        nesterov: Orthogonalise the Nesterov look-ahead ``(1 − μ)·G + μ·B`` instead of ``B``.
        ns_coefficients: ``"quintic"``, ``"polar_express"``, ``"newton_schulz"``, or ``(a, b, c)`` triple(s).
        eps: Lower clamp of the Frobenius norm that normalises the input of Newton–Schulz.
        ns_steps: Newton–Schulz iterations.
        adjust_lr_fn: ``"original"`` (``√max(1, rows/cols)``; also ``None``) or ``"match_rms_adamw"``.
        compute_dtype: ``"bfloat16"``, ``"float32"`` or ``"auto"`` (bfloat16 where the device is fast in it).
        ns_form: ``"standard"``, ``"gram"``, ``"standard-symmetric"`` or ``"gram-symmetric"``.
        compile: Compile Newton–Schulz (``True``), run it eagerly (``False``), or ``"auto"``: on CUDA.
        qk_clip: Bound the attention logits after each step (`lightning_canzona.QKClip`); ``None``: off.
        **kwargs: AdamW settings, ``check_finite``, ``stochastic_rounding``, ``plan``: `MatrixOptimizer`.
    """

    algorithm = "muon"
    rule = MuonRule

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
        defaults = _defaults(self, locals())  # first: it takes a variant's settings (beta2) out of kwargs
        super().__init__(params, defaults, **kwargs)
        self.qk_clip = _qk_clip_setting(qk_clip)


class NorMuon(Muon):
    """NorMuon (Muon normalised per output neuron) for weight matrices, AdamW for everything else.

    Args:
        beta2: Decay of each output neuron's second moment (dion's ``muon_beta2``).
        **kwargs: As `Muon`'s, as are the other arguments.
    """

    algorithm = "normuon"
    rule = NorMuonRule

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
        # Muon's signature and beta2 (a test checks it): built as Muon is, beta2 among its kwargs.
        own = {name: value for name, value in locals().items() if name not in ("self", "kwargs", "__class__")}
        super().__init__(**own, **kwargs)


def _qk_clip_setting(qk_clip: QKClip | None) -> QKClip | None:
    if qk_clip is not None and not isinstance(qk_clip, QKClip):
        raise TypeError(
            f"qk_clip must be a lightning_canzona.QKClip (QKClip(threshold=100.0)) or None, got {qk_clip!r}"
        )
    return qk_clip


class Shampoo(MatrixOptimizer):
    """Shampoo with Adam grafting for weight matrices, AdamW for everything else.

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param groups.
        lr: Learning rate γ (on the Adam scale, thanks to grafting).
        betas: ``(β₁, β₂)``: momentum, and the decay of the factors and the grafting second moment.
        eps: Adam grafting's ε.
        epsilon: Eigenvalue floor of each factor before its inverse root: see ``epsilon_mode``.
        weight_decay: Decoupled weight decay λ.
        precondition_frequency: Steps between inverse-root refreshes.
        start_preconditioning_step: First step that uses the Shampoo direction (grafted Adam before).
        max_precond_dim: Sides longer than this are not preconditioned.
        epsilon_mode: ``"relative"`` (to the largest eigenvalue) or ``"absolute"`` (as Meta's Shampoo).
        **kwargs: AdamW settings, ``check_finite``, ``stochastic_rounding``, ``plan``: `MatrixOptimizer`.
    """

    algorithm = "shampoo"
    rule = ShampooRule

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
        super().__init__(params, _defaults(self, locals()), **kwargs)


class SOAP(MatrixOptimizer):
    """SOAP (Adam in Shampoo's eigenbasis) for weight matrices, AdamW for everything else.

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param groups.
        lr: Learning rate γ.
        betas: Adam's ``(β₁, β₂)`` in the rotated coordinates.
        shampoo_beta: Decay of the Kronecker factors; ``None`` takes β₂.
        eps: Adam's ε.
        weight_decay: Decoupled weight decay λ.
        precondition_frequency: Steps between QR refreshes of the eigenbases.
        max_precond_dim: Sides longer than this keep the identity basis.
        weight_decay_order: ``"decay_first"`` (as ``torch.optim.AdamW``) or ``"update_first"`` (the authors').
        **kwargs: AdamW settings, ``check_finite``, ``stochastic_rounding``, ``plan``: `MatrixOptimizer`.
    """

    algorithm = "soap"
    rule = SOAPRule

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
        super().__init__(params, _defaults(self, locals()), **kwargs)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """`MatrixOptimizer.step`, then one more step counted in each SOAP group's ``soap_steps``."""
        loss = super().step(closure)
        for group in self.param_groups:
            if group["algorithm"] == self.algorithm:
                group["soap_steps"] = group.get("soap_steps", 0) + 1
        return loss
