"""`MaxLogits`: the largest pre-softmax attention logit of each query head, kept across forwards.

Fused attention kernels (``F.scaled_dot_product_attention``, flash attention) never materialise
the logits, so the maxima cost one more ``q·kᵀ`` product per attention call, computed here in
blocks of query rows, without gradients: under a causal mask each block multiplies only the keys
it may see, about half the product of full attention's logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Logits computed at once per block of query rows (64 MiB in float32): bounds the pass's memory.
BLOCK_ELEMENTS = 2**24
#: Query rows per block under a causal mask: the keys after a block's last row are never multiplied.
CAUSAL_BLOCK_ROWS = 128


class MaxLogits:
    """The largest logit ``q·k · scaling`` of each query head over the forwards since `take`."""

    def __init__(self) -> None:
        self._maxima: Tensor | None = None

    @torch.no_grad()
    def observe(
        self,
        query: Tensor,
        key: Tensor,
        scaling: float,
        mask: Tensor | None = None,
        causal: bool = False,
    ) -> None:
        """Fold one attention call's logits into the maxima.

        Args:
            query: ``(batch, heads, queries, head_dim)``.
            key: ``(batch, kv_heads, keys, head_dim)``; query head ``h`` attends with key head
                ``h // (heads // kv_heads)``, as grouped-query attention repeats them.
            scaling: The factor of the logits (``head_dim ** -0.5`` in most models).
            mask: Boolean (``True`` attends) or additive, broadcastable to ``(batch, heads,
                queries, keys)``: positions it masks out do not count.
            causal: Query ``i`` sees keys ``0..i`` only (``is_causal`` of
                ``F.scaled_dot_product_attention``).
        """
        batch, heads, queries, _ = query.shape
        kv_heads, keys = key.shape[1], key.shape[2]
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} key heads evenly")
        key = key.repeat_interleave(heads // kv_heads, dim=1).transpose(-2, -1)
        rows = max(1, BLOCK_ELEMENTS // max(1, batch * heads * keys))
        if causal:  # smaller blocks skip more of the keys no query of theirs sees
            rows = min(rows, CAUSAL_BLOCK_ROWS)
        maxima = torch.full((heads,), -torch.inf, dtype=query.dtype, device=query.device)
        for start in range(0, queries, rows):
            end = min(queries, start + rows)
            seen = min(end, keys) if causal else keys  # the keys any query of the block may see
            products = query[:, :, start:end] @ key[..., :seen]
            if causal:
                position = torch.arange(start, end, device=query.device)[:, None]
                products.masked_fill_(torch.arange(seen, device=query.device) > position, -torch.inf)
            if mask is not None:
                block = mask[..., start:end, :seen] if mask.shape[-2] > 1 else mask[..., :seen]
                if block.dtype == torch.bool:
                    products.masked_fill_(~block, -torch.inf)
                else:  # additive, to the logits: to the products, divided by the scaling
                    products = products + block.to(products.dtype) / scaling
            # The maximum of the products times the (positive) scaling: no pass over the block for it.
            maxima = torch.maximum(maxima, products.amax(dim=(0, 2, 3)))
        maxima = maxima.float() * scaling
        self._maxima = maxima if self._maxima is None else torch.maximum(self._maxima, maxima)

    def take(self) -> Tensor | None:
        """The maxima since the last call (``None``: no forward observed), and start afresh."""
        maxima, self._maxima = self._maxima, None
        return maxima
