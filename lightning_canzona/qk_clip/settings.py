"""`QKClip`: the setting that turns on Kimi K2's QK-clip for a Muon-family optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class QKClip:
    """Bound every attention head's largest pre-softmax logit (MuonClip's QK-clip, Kimi K2).

    After each optimizer step, a head ``h`` whose largest logit ``S_h = max q·k · scaling`` over the
    step's training batches exceeded ``threshold`` has its query rows scaled by ``γ_h^alpha`` and
    its key rows by ``γ^(1 − alpha)``, with ``γ_h = threshold / S_h``: its logits on the same
    batch then stay within ``threshold``. A key head shared by several query heads (grouped-query
    attention) takes the smallest ``γ`` of its group, so that every head of the group is bounded.

    Attributes:
        threshold: τ, the largest logit left alone (Kimi K2 trained with 100).
        alpha: How the scale splits between queries (``γ^alpha``) and keys (``γ^(1 − alpha)``).
    """

    threshold: float = 100.0
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise ValueError(f"QKClip threshold must be a number > 0, got {self.threshold!r}")
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"QKClip threshold must be a finite number > 0, got {self.threshold!r}")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not 0 <= self.alpha <= 1
        ):
            raise ValueError(f"QKClip alpha must lie in [0, 1], got {self.alpha!r}")
