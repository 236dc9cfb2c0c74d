"""Where an attention layer's query and key heads lie, and the scales QK-clip gives them.

Pure per-layer logic, free of ``torch.distributed``: `AttentionHeads` names the parameters and
rows of each head; `head_scales` turns the heads' largest logits into the query and key heads'
factors; `row_scales` spreads them over a parameter's rows (the rows of other heads, and of
values in a fused projection, keep 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_canzona.qk_clip.logits import MaxLogits


@dataclass(frozen=True)
class HeadRows:
    """Heads laid out in a parameter's rows: head ``h`` holds rows ``first_row + h·head_dim``
    to ``first_row + (h + 1)·head_dim`` (a projection's weight and its bias, or a part of a
    fused query/key/value projection).

    Attributes:
        param: The parameter's name.
        first_row: The row where the first head starts.
    """

    param: str
    first_row: int = 0


@dataclass(frozen=True)
class AttentionHeads:
    """What QK-clip needs of one attention layer.

    Attributes:
        name: The layer's module name.
        num_heads: Query heads.
        num_kv_heads: Key heads; query head ``h`` uses key head ``h // (num_heads // num_kv_heads)``.
        head_dim: Rows of one head.
        query: Where the query heads lie (weight and, if any, bias).
        key: Where the key heads lie.
    """

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    query: tuple[HeadRows, ...]
    key: tuple[HeadRows, ...]

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Attention layer {self.name!r}: {self.num_heads} query heads cannot share "
                f"{self.num_kv_heads} key heads evenly"
            )

    def renamed(self, prefix: str) -> AttentionHeads:
        """The same layer with its module and parameter names under ``prefix`` (``"model."``)."""

        def under(rows: tuple[HeadRows, ...]) -> tuple[HeadRows, ...]:
            return tuple(HeadRows(prefix + r.param, r.first_row) for r in rows)

        return AttentionHeads(
            prefix + self.name if self.name else prefix.removesuffix("."),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            under(self.query),
            under(self.key),
        )

    @property
    def params(self) -> tuple[str, ...]:
        """The parameters QK-clip scales, each once."""
        return tuple(dict.fromkeys(r.param for r in self.query + self.key))


@runtime_checkable
class ClipsQueryKey(Protocol):
    """An attention module of one's own that QK-clip can bound (the bundled Qwen3's ``Attention``).

    It describes its heads, with parameter names relative to itself, and in each training forward
    passes its queries and keys (after any rotary embedding) to ``max_logits`` when it is set.
    """

    max_logits: MaxLogits | None

    def attention_heads(self) -> AttentionHeads: ...


def head_scales(maxima: Tensor, threshold: float, alpha: float, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """The factors of the query heads and of the key heads of one layer.

    ``γ_h = threshold / S_h`` for each query head whose largest logit ``S_h`` exceeds the threshold
    (1 for the others); query head ``h`` gets ``γ_h^alpha``, key head ``g`` gets
    ``(min of γ over its query heads)^(1 − alpha)``: each head's logits shrink by at least ``γ_h``.
    """
    gamma = torch.where(maxima > threshold, threshold / maxima, torch.ones_like(maxima))
    shared = gamma.view(num_kv_heads, -1).amin(dim=1)
    return gamma.pow(alpha), shared.pow(1.0 - alpha)


def row_scales(
    rows: int, param: str, layer: AttentionHeads, query_scales: Tensor, key_scales: Tensor
) -> Tensor:
    """The factor of each of ``param``'s ``rows`` rows: its head's, or 1."""
    scales = torch.ones(rows, dtype=query_scales.dtype, device=query_scales.device)
    for placed, factors in ((layer.query, query_scales), (layer.key, key_scales)):
        for head_rows in placed:
            if head_rows.param == param:
                start = head_rows.first_row
                scales[start : start + factors.numel() * layer.head_dim] = factors.repeat_interleave(
                    layer.head_dim
                )
    return scales
