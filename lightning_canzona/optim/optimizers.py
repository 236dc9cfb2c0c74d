"""The optimizers users construct: `Muon`, `NorMuon`, `Shampoo` and `SOAP`.

Each is a `torch.optim.Optimizer` holding its matrix groups and AdamW groups together; the
math and the settings (their names, defaults and checks) live in its rule, `lightning_canzona.rules`.
The signatures repeat the rules' settings for IDEs and LightningCLI; a test checks that they agree.
"""

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
    """The matrix groups' defaults from an ``__init__``'s ``locals()``: ``lr``, ``weight_decay``
    and the settings of the optimizer's `MatrixOptimizer.rule`, a variant's own (NorMuon's
    ``beta2``) taken out of ``kwargs``, whose names are checked first."""
    kwargs = arguments["kwargs"]
    optimizer.check_keywords(kwargs)
    names = ["lr", "weight_decay", *optimizer.rule.settings()]
    defaults = {name: value for name, value in arguments.items() if name in names}
    defaults.update((name, kwargs.pop(name)) for name in names if name not in defaults)
    if "betas" in defaults:  # kept as a tuple, whatever sequence was given
        defaults["betas"] = tuple(defaults["betas"])
    return defaults


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
            ``"float32"`` (IEEE float32 even where TF32 is enabled: `lightning_canzona.rules.base`),
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
            `lightning_canzona.rules.newton_schulz`). A loaded checkpoint keeps this setting, not the
            saved run's.
        qk_clip: Bound the attention logits after each step (MuonClip's QK-clip, Kimi K2): see
            `lightning_canzona.QKClip`; ``None`` leaves the weights as the update made them.
        **kwargs: AdamW-group settings (``adamw_lr``, ``adamw_betas``, ``adamw_eps``,
            ``adamw_weight_decay``), ``check_finite``, ``stochastic_rounding``, and ``plan``
            (a `lightning_canzona.PlanConfig`: how the updates are distributed): see
            `MatrixOptimizer`.
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

    `Muon` with ``beta2``; see `lightning_canzona.rules.normuon` for the update: each row of Muon's
    orthogonalised update is divided by the root of its running second moment, then the update is
    scaled back to Muon's Frobenius norm, so Muon's learning rates carry over.

    Args:
        beta2: Decay of each output neuron's second moment (dion's ``muon_beta2``).
        **kwargs: As `Muon`'s, as are the other arguments (the normalisation computes in float32
            whatever ``compute_dtype``).
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
        """`MatrixOptimizer.step`, then one more step counted in every SOAP group
        (``param_groups[i]["soap_steps"]``, the same on every rank: a step that raises raises on
        every rank): ``weight_decay_order="update_first"`` skips the first step's decay."""
        loss = super().step(closure)
        for group in self.param_groups:
            if group["algorithm"] == self.algorithm:
                group["soap_steps"] = group.get("soap_steps", 0) + 1
        return loss
