"""QK-clip for Hugging Face ``transformers`` models, through their own attention-function registry.

A ``transformers`` attention layer calls the function its config names
(``config._attn_implementation``: ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, …) with the
queries and keys after the rotary embedding. `record_max_logits` registers, under a name of its
own, a function that folds them into the layer's `MaxLogits` and then calls the model's own
function, and points the model at it: every attention path keeps working, unchanged. The
registry is found through the model's own modeling module (``ALL_ATTENTION_FUNCTIONS``), so this
package never imports ``transformers`` itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn

from lightning_canzona.compat import transformers_attention_implementation
from lightning_canzona.qk_clip.heads import AttentionHeads, HeadRows
from lightning_canzona.qk_clip.logits import MaxLogits

#: The attribute of an attention layer that holds the recorder of its logits, where followed.
RECORDER = "canzona_max_logits"
PREFIX = "canzona_max_logits+"


def attention_layers(model: nn.Module) -> Iterator[tuple[nn.Module, AttentionHeads]]:
    """The attention layers of a ``transformers`` model, with names relative to it: modules with a
    ``head_dim`` and separate ``q_proj`` and ``k_proj`` projections (Llama, Mistral, Qwen2, …) or a
    fused ``qkv_proj`` whose rows are all queries, then all keys, then all values (Phi-3)."""
    for name, module in model.named_modules():
        head_dim, config = getattr(module, "head_dim", None), getattr(module, "config", None)
        if not isinstance(head_dim, int) or config is None:
            continue
        query, key, fused = (getattr(module, n, None) for n in ("q_proj", "k_proj", "qkv_proj"))
        prefix = f"{name}." if name else ""
        if isinstance(query, nn.Linear) and isinstance(key, nn.Linear):
            heads, kv_heads = query.weight.shape[0] // head_dim, key.weight.shape[0] // head_dim
            query_rows, key_rows = _rows(query, f"{prefix}q_proj", 0), _rows(key, f"{prefix}k_proj", 0)
        elif isinstance(fused, nn.Linear):
            heads = config.num_attention_heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            query_rows = _rows(fused, f"{prefix}qkv_proj", 0)
            key_rows = _rows(fused, f"{prefix}qkv_proj", heads * head_dim)
        else:
            continue
        yield module, AttentionHeads(name, heads, kv_heads, head_dim, query_rows, key_rows)


def _rows(projection: nn.Linear, name: str, first_row: int) -> tuple[HeadRows, ...]:
    names = [f"{name}.weight"] + ([f"{name}.bias"] if projection.bias is not None else [])
    return tuple(HeadRows(n, first_row) for n in names)


def record_max_logits(model: nn.Module, recorders: dict[nn.Module, MaxLogits]) -> None:
    """Make ``model``'s attention layers (keys of ``recorders``) fold their training forwards'
    logits into their recorders."""
    original = transformers_attention_implementation(model)
    if original.startswith(PREFIX):  # attached before: the model's own function is behind ours
        original = original.removeprefix(PREFIX)
    name = PREFIX + original
    registry = _registry(model)
    registry.register(name, _recording(original, registry))
    for module, recorder in recorders.items():
        setattr(module, RECORDER, recorder)  # on the layer itself: any number of models share the function
    model.set_attn_implementation(name)


def _registry(module: nn.Module) -> Any:
    """The attention-function registry (``transformers``' ``AttentionInterface``) that ``module``'s
    modeling file dispatches through."""
    return sys.modules[type(module).__module__].ALL_ATTENTION_FUNCTIONS


def _recording(original: str, registry: Any) -> Callable[..., Any]:
    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        **kwargs: Any,
    ) -> Any:
        recorder = getattr(module, RECORDER, None)
        if recorder is not None and module.training:
            scaling = kwargs.get("scaling")
            causal = attention_mask is None and getattr(module, "is_causal", True) and query.shape[2] > 1
            recorder.observe(
                query,
                key,
                query.shape[-1] ** -0.5 if scaling is None else scaling,
                mask=attention_mask,
                causal=causal,
            )
        return _function(module, original, registry)(module, query, key, value, attention_mask, **kwargs)

    return attention


def _function(module: nn.Module, implementation: str, registry: Any) -> Callable[..., Any]:
    """The attention function ``implementation`` names for ``module``: a registered one, or the
    ``eager_attention_forward`` of the module's own modeling file."""
    if implementation != "eager" and implementation in registry:
        return registry[implementation]
    return sys.modules[type(module).__module__].eager_attention_forward
