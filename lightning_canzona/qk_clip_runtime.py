"""QK-clip at run time: the logits recorded in the forward, one MAX all-reduce, rows rescaled.

`attach_qk_clip` finds the model's attention layers, has each record its training forwards'
largest logit per query head (`MaxLogits`), and hooks the optimizer: after every step, each rank
writes the maxima of the heads it computes (its tensor-parallel heads) into one vector of all the
model's heads, a single MAX all-reduce over every rank makes it global (the heads of other TP
ranks, the batches of other data-parallel ranks, every gradient-accumulation micro-batch), and
each rank scales the query and key rows it holds (FSDP2 and TP shards alike) by its head's factor.
Nothing waits on the host: the factors stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_canzona import huggingface
from lightning_canzona.distributed.layout import local_shard, local_tensor
from lightning_canzona.qk_clip import transformers as hf_attention
from lightning_canzona.qk_clip.heads import AttentionHeads, ClipsQueryKey, head_scales, row_scales
from lightning_canzona.qk_clip.logits import MaxLogits
from lightning_canzona.qk_clip.settings import QKClip

#: The mesh dimension FSDP2 shards over and gathers in the forward (both strategies' name).
DATA_PARALLEL = "data_parallel"


@dataclass
class _Layer:
    heads: AttentionHeads
    recorder: MaxLogits
    offset: int  # of its query heads in the vector of all heads
    local_heads: Tensor  # the query heads this rank's forward computes, in its order


@dataclass
class _Rows:
    param: Tensor
    layer: _Layer
    name: str
    rows: Tensor  # the global rows of this rank's local tensor, in its order


class QKClipRuntime:
    """QK-clip of one model, run after each step of one optimizer (`attach_qk_clip`).

    After each step, on the device and the same on every rank: ``maxima``, the largest logit of
    each query head in the step's training forwards, before clipping (the layers' heads in module
    order; ``-inf`` for a head no forward computed), ``max_logit``, the largest of them, and
    ``clipped_heads``, how many exceeded the threshold.
    """

    def __init__(self, model: nn.Module, optimizer: Optimizer, settings: QKClip) -> None:
        self.settings = settings
        params = dict(model.named_parameters(remove_duplicate=False))
        found = _attention_layers(model)
        self.layers: list[_Layer] = []
        offset = 0
        for module, heads in found:
            query_param = params[heads.query[0].param]
            self.layers.append(_Layer(heads, MaxLogits(), offset, _forward_heads(query_param, heads)))
            offset += heads.num_heads
            if isinstance(module, ClipsQueryKey):
                module.max_logits = self.layers[-1].recorder
        for _, hf_model in huggingface.transformers_models(model):
            inside = set(hf_model.modules())
            recorders = {m: layer.recorder for (m, _), layer in zip(found, self.layers) if m in inside}
            if recorders:
                hf_attention.record_max_logits(hf_model, recorders)
        self.num_heads = offset
        self._rows = [
            _Rows(params[name], layer, name, _rows(params[name]))
            for layer in self.layers
            for name in layer.heads.params
        ]
        device = local_tensor(self._rows[0].param).device
        self.maxima = torch.full((self.num_heads,), -torch.inf, device=device)
        self.max_logit = torch.full((), -torch.inf, device=device)
        self.clipped_heads = torch.zeros((), dtype=torch.long, device=device)
        self._handle: RemovableHandle = optimizer.register_step_post_hook(lambda *_: self.clip())

    def detach(self) -> None:
        """Stop clipping after the optimizer's steps."""
        self._handle.remove()

    @torch.no_grad()
    def clip(self) -> None:
        """Rescale the query and key rows of every head whose logits exceeded the threshold in the
        training forwards since the last call (collective: every rank calls it)."""
        device = self.max_logit.device
        maxima = torch.full((self.num_heads,), -torch.inf, device=device)
        for layer in self.layers:
            recorded = layer.recorder.take()
            if recorded is not None:
                if recorded.numel() != layer.local_heads.numel():
                    raise RuntimeError(
                        f"QK-clip: attention layer {layer.heads.name!r} computed {recorded.numel()} query "
                        f"heads on this rank, its parameters hold {layer.local_heads.numel()}."
                    )
                maxima[layer.offset + layer.local_heads] = recorded.to(device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        threshold, alpha = self.settings.threshold, self.settings.alpha
        self.maxima, self.max_logit = maxima, maxima.max()
        self.clipped_heads = (maxima > threshold).sum()
        scales = {}
        for layer in self.layers:
            heads = layer.heads
            layer_maxima = maxima[layer.offset : layer.offset + heads.num_heads]
            scales[id(layer)] = head_scales(layer_maxima, threshold, alpha, heads.num_kv_heads)
        for rows in self._rows:
            query_scales, key_scales = scales[id(rows.layer)]
            full = row_scales(rows.param.shape[0], rows.name, rows.layer.heads, query_scales, key_scales)
            local = local_tensor(rows.param)
            local.mul_(full[rows.rows].view(-1, *[1] * (local.ndim - 1)))

    def describe(self) -> str:
        """One line: what QK-clip follows and what it costs per step."""
        scaled = sum(local_tensor(rows.param).numel() * rows.param.element_size() for rows in self._rows)
        return (
            f"lightning_canzona: QK-clip (threshold {self.settings.threshold:g}, alpha "
            f"{self.settings.alpha:g}) on {len(self.layers)} attention layers, {self.num_heads} query heads. "
            f"Per step: one MAX all-reduce of {4 * self.num_heads} B, {scaled / 2**20:.2f} MiB of query/key "
            "rows rescaled on this rank, and in each training forward one more q·kᵀ product per "
            "attention layer for the largest logits (causal: only the keys its queries see)."
        )


def attach_qk_clip(model: nn.Module, optimizer: Optimizer, settings: QKClip | None = None) -> QKClipRuntime:
    """Clip ``model``'s query/key heads after every step of ``optimizer`` (MuonClip).

    The strategies call it for an optimizer built with ``qk_clip=QKClip(...)``; call it yourself in
    a loop of your own (one process, or your own parallelism), after sharding the model. Attaching
    again replaces the previous attachment.

    Args:
        model: The model whose attention layers are bounded: the bundled Qwen3 (built with
            ``qk_norm=False``), a ``transformers`` model with ``q_proj``/``k_proj`` or a fused
            ``qkv_proj``, or a module holding either.
        optimizer: The optimizer after whose steps to clip.
        settings: The threshold and split; ``None`` takes ``optimizer.qk_clip``.

    Raises:
        ValueError: No attention layer is found, or one normalises its queries and keys per head
            (QK-norm), which makes its logits independent of the scale QK-clip changes.
    """
    settings = settings or getattr(optimizer, "qk_clip", None)
    if not isinstance(settings, QKClip):
        raise ValueError(f"attach_qk_clip needs QKClip settings, got {settings!r}")
    previous = getattr(optimizer, "qk_clip_runtime", None)
    if previous is not None:
        previous.detach()
    runtime = QKClipRuntime(model, optimizer, settings)
    optimizer.qk_clip_runtime = runtime  # type: ignore[attr-defined]
    return runtime


def _attention_layers(model: nn.Module) -> list[tuple[nn.Module, AttentionHeads]]:
    """Every attention layer QK-clip knows in ``model``, with names relative to it, in module order."""
    found: dict[nn.Module, AttentionHeads] = {}
    for name, module in model.named_modules():
        if isinstance(module, ClipsQueryKey):
            found[module] = module.attention_heads().renamed(f"{name}." if name else "")
    for prefix, hf_model in huggingface.transformers_models(model):
        for module, heads in hf_attention.attention_layers(hf_model):
            found[module] = heads.renamed(f"{prefix}." if prefix else "")
    if not found:
        raise ValueError(
            f"QK-clip found no attention layer in {type(model).__name__}: it bounds the bundled Qwen3's "
            "Attention and transformers attention layers with q_proj and k_proj (or a fused qkv_proj). "
            "Leave qk_clip unset for this model."
        )
    for module, heads in found.items():
        norms = [n for n in ("q_norm", "k_norm") if isinstance(getattr(module, n, None), nn.Module)]
        if norms:
            raise ValueError(
                f"Attention layer {heads.name!r} normalises each head's queries and keys "
                f"({', '.join(norms)}): "
                "its logits do not depend on the scale of its query and key weights, so QK-clip cannot "
                "bound them (QK-norm bounds them already). Leave qk_clip unset for this model, or build "
                "it without QK-norm (the bundled Qwen3: qk_norm=False)."
            )
    return list(found.items())


def _rows(param: Tensor, gathered: tuple[str, ...] = ()) -> Tensor:
    """The global rows of ``param``'s local tensor on this rank, in its order, with the mesh
    dimensions named in ``gathered`` taken as gathered (`layout.local_shard`)."""
    device = local_tensor(param).device
    if not isinstance(param, DTensor):
        return torch.arange(param.shape[0], device=device)
    runs = local_shard(param, gathered=gathered).runs[0]
    return torch.cat(
        [torch.arange(start, start + length) for start, length in runs] or [torch.zeros(0, dtype=torch.long)]
    ).to(device)


def _forward_heads(param: Tensor, heads: AttentionHeads) -> Tensor:
    """The query heads that this rank's forward computes (its tensor-parallel rows of ``param``;
    FSDP2 gathers the data-parallel ones before the forward), in order."""
    rows, first = _rows(param, gathered=(DATA_PARALLEL,)), heads.query[0].first_row
    rows = rows[(rows >= first) & (rows < first + heads.num_heads * heads.head_dim)]
    return torch.unique_consecutive((rows - first) // heads.head_dim)
