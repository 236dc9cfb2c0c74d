"""QK-clip distributed equals QK-clip on one process, and bounds the logits it clips.

The bundled decoder without QK-norm, composed as the strategies compose it (TP plan, then FSDP2),
trains with ``Muon(qk_clip=...)`` on dp 4, tp 2 and dp 2 × tp 2; a one-process reference trains
the same model on the whole batches with plain Muon and clips by hand, from the logits written
out in full (`_max_logits`) and the published rule. A transformers Llama (its attention through
the registry, its own TP plan) is checked against `attach_qk_clip` on one process.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from multiprocess import DEVICE, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

import lightning_canzona as lc
from lightning_canzona.composition import compose
from lightning_canzona.models.qwen3 import Qwen3, Qwen3Config, apply_rotary, rotary_tables

STEPS, BATCH, SEQ, VOCAB = 4, 4, 12, 64
MUON = {"lr": 0.02, "weight_decay": 0.01, "compute_dtype": "float32", "adamw_lr": 3e-3}
ALPHA = 0.4  # not 0.5: a wrong split between queries and keys shows
#: dp 4: 60 query rows give each rank 1.5 heads, 30 key rows split 8 + 8 + 8 + 6.
UNEVEN = Qwen3Config(VOCAB, 40, 64, 2, 6, 3, head_dim=10, rope_theta=1e4, qk_norm=False)
#: tp 2: 3 query heads and 1 key head per rank.
SPLITTABLE = Qwen3Config(VOCAB, 40, 64, 2, 6, 2, head_dim=10, rope_theta=1e4, qk_norm=False)


def _batches() -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS + 1, BATCH, SEQ), generator=torch.Generator().manual_seed(3)).to(
        DEVICE
    )


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _model(config: Qwen3Config) -> Qwen3:
    """Queries and keys 8× the usual scale: logits of 10–40 that QK-clip has work to do on."""
    torch.manual_seed(0)
    model = Qwen3(config)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model.to(DEVICE)


@torch.no_grad()
def _max_logits(model: Qwen3, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's largest logit per query head, from the logits written out in full."""
    config, x = model.config, model.embed_tokens(tokens)
    cos, sin = rotary_tables(tokens.shape[1], config.head_dim, config.rope_theta, tokens.device)
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).triu(1)
    maxima = []
    for layer in model.layers:
        attention, hidden = layer.self_attn, layer.input_layernorm(x)

        def heads(projection: nn.Linear, hidden=hidden) -> torch.Tensor:
            split = projection(hidden).view(*tokens.shape, -1, config.head_dim).transpose(1, 2)
            return apply_rotary(split, cos, sin)

        query, key = heads(attention.q_proj), heads(attention.k_proj)
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        logits = (query @ key.transpose(-2, -1) * config.head_dim**-0.5).masked_fill(causal, -torch.inf)
        maxima.append(logits.amax(dim=(0, 2, 3)))
        x = layer(x, cos, sin)
    return maxima


@torch.no_grad()
def _clip_by_hand(model: Qwen3, maxima: list[torch.Tensor], threshold: float) -> None:
    """Kimi K2's rule on the full weights: query head h by γ_h^α, key head g by (min γ)^(1-α)."""
    dim = model.config.head_dim
    for layer, layer_maxima in zip(model.layers, maxima):
        gamma = torch.clamp(threshold / layer_maxima, max=1.0)
        per_key = gamma.view(model.config.num_key_value_heads, -1).amin(dim=1)
        layer.self_attn.q_proj.weight.mul_(gamma.pow(ALPHA).repeat_interleave(dim)[:, None])
        layer.self_attn.k_proj.weight.mul_(per_key.pow(1 - ALPHA).repeat_interleave(dim)[:, None])


def _local(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if isinstance(like, DTensor):
        return distribute_tensor(
            tensor.detach(), like.device_mesh, like.placements, src_data_rank=None
        ).to_local()
    return tensor.detach()


def _check_updates(
    model: nn.Module, reference: nn.Module, initial: dict, label: str, tolerance: float = 3e-5
) -> None:
    """Each weight's update equals the reference's within the Fabric and transformers tests'
    bounds (tensor parallelism sums partial products in another order, float32 noise that
    Newton-Schulz amplifies); each rank checks its own shard."""
    ulps = 16 * torch.finfo(torch.float32).eps
    params = dict(model.named_parameters())
    for name, expected in reference.named_parameters():
        actual = params[name]
        local = actual.to_local() if isinstance(actual, DTensor) else actual.detach()
        expected_update = expected.detach() - initial[name]
        difference = local - _local(initial[name], actual) - _local(expected_update, actual)
        bound = tolerance * float(expected_update.norm()) + ulps * float(initial[name].norm())
        assert float(difference.norm()) <= bound, (label, name, float(difference.norm()), bound)


def _check_bundled(rank: int, mesh_shape: tuple[int, int], config: Qwen3Config) -> None:
    label = f"dp {mesh_shape[0]} × tp {mesh_shape[1]}"
    mesh = init_device_mesh(DEVICE, mesh_shape, mesh_dim_names=("data_parallel", "tensor_parallel"))
    reference = _model(config)
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    model = copy.deepcopy(reference)
    compose(model, mesh)
    batches = _batches()
    # Clipping must fire: half the first layer's heads exceed the threshold at the first step.
    threshold = float(_max_logits(reference, batches[0, :, :-1])[0].median())
    optimizer = lc.Muon(lc.matrix_param_groups(model), **MUON, qk_clip=lc.QKClip(threshold, ALPHA))
    runtime = lc.attach_qk_clip(model, optimizer)
    expected_optimizer = lc.Muon(lc.matrix_param_groups(reference), **MUON)
    dp, dp_rank = mesh_shape[0], mesh.get_local_rank("data_parallel")
    params = dict(model.named_parameters())
    for step in range(STEPS):
        tokens = batches[step]
        maxima = _max_logits(reference, tokens[:, :-1])  # what the loss's forward sees
        _loss(reference, tokens).backward()
        share = BATCH // dp
        _loss(model, tokens[dp_rank * share : (dp_rank + 1) * share]).backward()
        if step == 1:  # a None gradient: the step skips the weight, QK-clip still scales it
            reference.layers[0].self_attn.q_proj.weight.grad = None
            params["layers.0.self_attn.q_proj.weight"].grad = None
        expected_optimizer.step()
        _clip_by_hand(reference, maxima, threshold)
        optimizer.step()
        overall = float(torch.cat(maxima).max())
        # Heads clipped the step before sit at the threshold: those within rounding of it may
        # count either way.
        surely, perhaps = (int(sum((m > threshold * f).sum() for m in maxima)) for f in (1 + 1e-5, 1 - 1e-5))
        assert surely > 0, f"{label}, step {step}: nothing to clip"
        assert abs(float(runtime.max_logit) - overall) <= 1e-5 * overall, (label, step, overall)
        assert surely <= int(runtime.clipped_heads) <= perhaps, (label, step, int(runtime.clipped_heads))
        for optimizer_ in (optimizer, expected_optimizer):
            optimizer_.zero_grad()
    _check_updates(model, reference, initial, label)

    # Learning rate 0 and a lower threshold (attached anew): the clip alone acts, and on the same
    # batch leaves the first layer's logits within it. (A deeper layer's input changed with the
    # clip of the layers before it: its logits may land a little above.)
    lower = 0.7 * threshold
    runtime = lc.attach_qk_clip(model, optimizer, lc.QKClip(lower, ALPHA))
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    share = BATCH // dp
    tokens = batches[STEPS, dp_rank * share : (dp_rank + 1) * share]
    _loss(model, tokens).backward()
    optimizer.step()
    optimizer.zero_grad()
    assert int(runtime.clipped_heads) > 0, label
    with torch.no_grad():
        model(tokens[:, :-1])  # in training mode: the logits after the clip are recorded
    runtime.clip()
    first = runtime.maxima[: config.num_attention_heads]
    assert float(first.max()) <= lower * (1 + 1e-5), (label, first.tolist(), lower)


def _llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        attention_bias=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model.to(DEVICE)


def _check_transformers(rank: int) -> None:
    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    reference = _llama()
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    model = copy.deepcopy(reference)
    compose(model, mesh)
    settings = lc.QKClip(threshold=4.0, alpha=ALPHA)  # logits of 3–6: about half the heads clip
    optimizer = lc.Muon(lc.matrix_param_groups(model), **MUON, qk_clip=settings)
    runtime = lc.attach_qk_clip(model, optimizer)
    expected_optimizer = lc.Muon(lc.matrix_param_groups(reference), **MUON, qk_clip=settings)
    expected_runtime = lc.attach_qk_clip(reference, expected_optimizer)
    batches, share, dp_rank = _batches(), BATCH // 2, mesh.get_local_rank("data_parallel")
    for step in range(3):
        tokens = batches[step]
        reference(tokens, labels=tokens).loss.backward()
        local = tokens[dp_rank * share : (dp_rank + 1) * share]
        model(local, labels=local).loss.backward()
        expected_optimizer.step()
        optimizer.step()
        assert step > 0 or int(expected_runtime.clipped_heads) > 0  # it fires at the first step
        assert abs(int(runtime.clipped_heads) - int(expected_runtime.clipped_heads)) <= 1  # at τ
        torch.testing.assert_close(runtime.max_logit, expected_runtime.max_logit, rtol=1e-5, atol=0)
        optimizer.zero_grad()
        expected_optimizer.zero_grad()
    # AdamW divides the biases' small gradients by their own root mean square: TP's reordered sums
    # show there relatively larger (3.7e-5 of the k bias's update).
    _check_updates(model, reference, initial, "transformers Llama, dp 2 × tp 2", tolerance=1e-4)


def _on_four_ranks(rank: int, world_size: int) -> None:
    _check_bundled(rank, (4, 1), UNEVEN)
    _check_bundled(rank, (2, 2), SPLITTABLE)
    _check_transformers(rank)


def _on_two_ranks(rank: int, world_size: int) -> None:
    _check_bundled(rank, (1, 2), SPLITTABLE)


def test_qk_clip_on_dp4_and_dp2_tp2_equals_one_process_and_bounds_the_logits() -> None:
    run_on_ranks(4, _on_four_ranks)


def test_qk_clip_on_tp2_equals_one_process_and_bounds_the_logits() -> None:
    run_on_ranks(2, _on_two_ranks)
