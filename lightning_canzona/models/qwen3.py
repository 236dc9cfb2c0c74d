"""A Qwen3-style decoder: RMSNorm, grouped-query attention with QK-norm, RoPE and SwiGLU, or
Qwen3-MoE's top-k routed experts in place of the SwiGLU.

The presets carry the real Qwen3 shapes (dense 0.6B–32B, mixture-of-experts 30B-A3B and
235B-A22B; build them on the meta device to plan without weights) and ``tiny`` / ``tiny-moe``
byte-level models that train on a CPU in minutes. Attention reads its head count from the
projection's output, so the same code runs on tensor-parallel shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_canzona.qk_clip import AttentionHeads, HeadRows, MaxLogits


@dataclass(frozen=True)
class Qwen3Config:
    """Shapes and constants of a Qwen3-style decoder.

    Attributes:
        vocab_size: Token vocabulary size.
        hidden_size: Residual stream width.
        intermediate_size: SwiGLU hidden width.
        num_hidden_layers: Decoder blocks.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (grouped-query attention).
        head_dim: Width of one head.
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: Share the embedding matrix with the output head.
        num_experts: Experts per mixture-of-experts layer; 0 for a dense SwiGLU in every block.
        num_experts_per_tok: Experts each token is routed to (top-k).
        moe_intermediate_size: SwiGLU hidden width of one expert.
        router_aux_loss_coef: Weight of the load-balancing loss in the training loss.
        qk_norm: RMS-normalise each head's queries and keys (Qwen3); ``False`` leaves them as the
            projections make them (Llama-style), where `lightning_canzona.QKClip` bounds the logits.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    qk_norm: bool = True


_QWEN3_VOCAB = 151_936

PRESETS: dict[str, Qwen3Config] = {
    "tiny": Qwen3Config(256, 128, 384, 4, 4, 2, head_dim=32, rope_theta=10_000.0),
    # CPU-sized with Qwen3's heterogeneity (a 3× wide MLP, 4× narrower key/value projections) and
    # an odd number of blocks, so that owners by index (round-robin) are visibly unbalanced.
    "small": Qwen3Config(256, 256, 768, 3, 8, 2, head_dim=32, rope_theta=10_000.0),
    "0.6B": Qwen3Config(_QWEN3_VOCAB, 1024, 3072, 28, 16, 8, tie_word_embeddings=True),
    "1.7B": Qwen3Config(_QWEN3_VOCAB, 2048, 6144, 28, 16, 8, tie_word_embeddings=True),
    "4B": Qwen3Config(_QWEN3_VOCAB, 2560, 9728, 36, 32, 8, tie_word_embeddings=True),
    "8B": Qwen3Config(_QWEN3_VOCAB, 4096, 12288, 36, 32, 8),
    "14B": Qwen3Config(_QWEN3_VOCAB, 5120, 17408, 40, 40, 8),
    "32B": Qwen3Config(_QWEN3_VOCAB, 5120, 25600, 64, 64, 8),
    # Mixture-of-experts: every block routes each token to 8 of 128 experts.
    "tiny-moe": Qwen3Config(
        256,
        128,
        384,
        4,
        4,
        2,
        head_dim=32,
        rope_theta=10_000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
    ),
    "30B-A3B": Qwen3Config(
        _QWEN3_VOCAB, 2048, 6144, 48, 32, 4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768
    ),
    "235B-A22B": Qwen3Config(
        _QWEN3_VOCAB,
        4096,
        12288,
        94,
        64,
        4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
    ),
}


def resolve_config(preset: str | Qwen3Config) -> Qwen3Config:
    """A config from a preset name (see `PRESETS`) or itself."""
    if isinstance(preset, Qwen3Config):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"Unknown Qwen3 preset {preset!r}; choose one of {list(PRESETS)}") from None


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of RoPE angles, each ``(seq_len, head_dim)`` (halves repeated)."""
    inverse_frequency = theta ** (
        -torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inverse_frequency)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``(batch, heads, seq, head_dim)`` by the RoPE angles."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention, with RMS-normalised queries and keys (QK-norm) unless
    the config turns it off.

    While ``max_logits`` is set (QK-clip does it, `lightning_canzona.qk_clip`), each training
    forward also folds its largest logit per head into it.
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.max_logits: MaxLogits | None = None

    def attention_heads(self) -> AttentionHeads:
        """Where the query and key heads lie (`lightning_canzona.qk_clip.ClipsQueryKey`)."""
        heads = self.q_proj.weight.shape[0] // self.head_dim  # global shapes, also when sharded
        kv_heads = self.k_proj.weight.shape[0] // self.head_dim
        query, key = (HeadRows("q_proj.weight"),), (HeadRows("k_proj.weight"),)
        return AttentionHeads("", heads, kv_heads, self.head_dim, query, key)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        # Head counts come from the (possibly tensor-parallel, local) projection widths.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        if self.max_logits is not None and self.training:
            self.max_logits.observe(q, k, self.head_dim**-0.5, causal=True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) ⊙ up(x))``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts as two stacks, as transformers 5 stores them.

    ``gate_up_proj`` is ``[experts, 2·moe_intermediate, hidden]`` (gate rows, then up rows) and
    ``down_proj`` ``[experts, hidden, moe_intermediate]``: 3-D stacks that
    `lightning_canzona.matrix_param_groups` gives to the matrix rule, one matrix per expert.
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """``x`` ``(tokens, hidden)``; each token's ``experts`` and routing ``weights`` ``(tokens, k)``."""
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            token, slot = (experts == expert).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return out


class MixtureOfExperts(nn.Module):
    """Top-k routed experts (Qwen3-MoE): a linear router, softmax, the k largest renormalised.

    After each forward, `balance_loss` holds the Switch-Transformer load-balancing loss
    ``E · Σ_e f_e · p_e`` (``f_e``: fraction of routed slots that went to expert ``e``, ``p_e``: its
    mean router probability): 1 when routing is uniform, up to ``E`` when one expert takes all.
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)
        self.balance_loss = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probabilities = F.softmax(self.router(tokens), dim=-1, dtype=torch.float32)
        weights, experts = probabilities.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        num_experts = probabilities.shape[-1]
        routed = F.one_hot(experts, num_experts).sum(dim=1).float().mean(dim=0) / self.top_k
        self.balance_loss = num_experts * (routed * probabilities.mean(dim=0)).sum()
        return self.experts(tokens, experts, weights).reshape(x.shape)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MixtureOfExperts(config) if config.num_experts else SwiGLU(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nn.Module):
    """The decoder: token embedding, ``num_hidden_layers`` blocks, final norm and output head."""

    def __init__(self, config: Qwen3Config | str = "tiny") -> None:
        super().__init__()
        self.config = resolve_config(config)
        config = self.config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, unit norms; a no-op on the meta device."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, Experts):
                nn.init.normal_(module.gate_up_proj, std=0.02)
                nn.init.normal_(module.down_proj, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """The decoder's TP plan (module function `tensor_parallel_plan`): what the strategies
        compose with FSDP2 when the model is given to them as it is (Fabric)."""
        return tensor_parallel_plan(self)

    def tensor_parallel_constraints(self) -> dict[str, int]:
        """The head counts and widths that a tensor-parallel size must divide."""
        return tensor_parallel_constraints(self.config)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(batch, seq, vocab)`` for token ids ``(batch, seq)``."""
        cos, sin = rotary_tables(tokens.shape[1], self.config.head_dim, self.config.rope_theta, tokens.device)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def balance_loss(self) -> Tensor:
        """The mean load-balancing loss of the mixture-of-experts layers in the last forward (0
        for a dense model)."""
        losses = [layer.mlp.balance_loss for layer in self.layers if isinstance(layer.mlp, MixtureOfExperts)]
        return torch.stack(losses).mean() if losses else torch.zeros(())


def tensor_parallel_plan(model: Qwen3) -> dict[str, ParallelStyle]:
    """Megatron-style TP plan of the decoder blocks, for ``parallelize_module``.

    Query/key/value and gate/up projections split their output features (``ColwiseParallel``:
    each rank computes whole heads and a slice of the MLP), output and down projections split
    their input features (``RowwiseParallel``: partial sums reduced once per sub-block). The QK-norm
    weights are shared by all heads while each rank sees only its own heads, so they are
    replicated DTensors over heads sharded on dim 2 (``SequenceParallel(sequence_dim=2)``): their
    gradients are then summed over the tensor-parallel ranks instead of diverging per rank. The
    embedding, the other norms and the head stay whole on every tensor-parallel rank. So do the
    router and the experts of a mixture-of-experts model: FSDP2 splits the expert stacks on the
    expert dimension, and each expert's update is computed on the rank that holds it.
    """
    plan: dict[str, ParallelStyle] = {}
    dense = not model.config.num_experts
    for index in range(len(model.layers)):
        prefix = f"layers.{index}"
        colwise = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        rowwise = ["self_attn.o_proj"]
        if dense:
            colwise += ["mlp.gate_proj", "mlp.up_proj"]
            rowwise += ["mlp.down_proj"]
        for name in colwise:
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in rowwise:
            plan[f"{prefix}.{name}"] = RowwiseParallel()
        for name in ("self_attn.q_norm", "self_attn.k_norm") if model.config.qk_norm else ():
            plan[f"{prefix}.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def tensor_parallel_constraints(config: Qwen3Config) -> dict[str, int]:
    """The config fields that `tensor_parallel_plan` splits over the tensor-parallel ranks: the
    query and key/value heads (each rank computes whole heads) and, in a dense model, the
    SwiGLU width (the experts of a mixture-of-experts model are not split over TP)."""
    fields = ["num_attention_heads", "num_key_value_heads"] + (
        [] if config.num_experts else ["intermediate_size"]
    )
    return {f"{type(config).__name__}.{field}": getattr(config, field) for field in fields}
