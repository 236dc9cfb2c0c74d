"""QK-clip's parts on one process: the recorded maxima against logits written out in full, the
factors against the published rule, the layers found in models, and the errors users meet."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_canzona as lc
from lightning_canzona.models.qwen3 import Qwen3, Qwen3Config
from lightning_canzona.qk_clip import AttentionHeads, HeadRows, MaxLogits, logits
from lightning_canzona.qk_clip.heads import head_scales, row_scales

TINY = Qwen3Config(64, 48, 96, 2, 6, 2, head_dim=8, rope_theta=1e4, qk_norm=False)


def _full_logits(query, key, scaling, mask=None, causal=False) -> torch.Tensor:
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = query @ key.transpose(-2, -1) * scaling
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask
    return scores.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("block_elements", [logits.BLOCK_ELEMENTS, 7 * 6 * 9])  # 1 and 9 blocks
def test_recorded_maxima_equal_the_full_logits_under_every_kind_of_mask(monkeypatch, block_elements) -> None:
    monkeypatch.setattr(logits, "BLOCK_ELEMENTS", block_elements)
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(2, 6, 9, 4, generator=generator), torch.randn(2, 3, 9, 4, generator=generator)
    padding = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    padding[1, ..., 6:] = False  # the second sequence's last 3 keys are padding
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    additive = torch.zeros(2, 1, 9, 9).masked_fill(~(causal & padding), torch.finfo(torch.float32).min)
    cases = [
        ({"causal": True}, {"causal": True}),
        ({"mask": padding & causal}, {"mask": padding & causal}),
        ({"mask": padding}, {"mask": padding}),  # (batch, 1, 1, keys): broadcast over the queries
        ({"mask": additive}, {"mask": additive}),
        ({}, {}),
    ]
    for recorded_with, expected_with in cases:
        recorder = MaxLogits()
        recorder.observe(query, key, 0.5, **recorded_with)
        torch.testing.assert_close(recorder.take(), _full_logits(query, key, 0.5, **expected_with))
    # Two forwards (micro-batches) fold into one maximum per head; `take` starts afresh.
    recorder = MaxLogits()
    recorder.observe(query[:1], key[:1], 0.5, causal=True)
    recorder.observe(query[1:], key[1:], 0.5, causal=True)
    torch.testing.assert_close(recorder.take(), _full_logits(query, key, 0.5, causal=True))
    assert recorder.take() is None


def test_head_factors_follow_kimi_k2_and_a_shared_key_head_takes_its_groups_smallest() -> None:
    maxima = torch.tensor([50.0, 200.0, 80.0, 400.0, -torch.inf, 100.0])  # 6 query heads, 2 key heads
    query, key = head_scales(maxima, threshold=100.0, alpha=0.25, num_kv_heads=2)
    gamma = torch.tensor([1.0, 0.5, 1.0, 0.25, 1.0, 1.0])
    torch.testing.assert_close(query, gamma**0.25)
    torch.testing.assert_close(key, torch.tensor([0.5, 0.25]) ** 0.75)
    # Every head's logits shrink by at least its own γ: query factor × its key head's factor.
    assert torch.all(query * key.repeat_interleave(3) <= gamma + 1e-7)


def test_row_factors_of_a_fused_projection_leave_the_value_rows_alone() -> None:
    heads = AttentionHeads("attn", 4, 2, 3, (HeadRows("qkv.weight", 0),), (HeadRows("qkv.weight", 12),))
    query, key = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0])
    rows = row_scales(24, "qkv.weight", heads, query, key)
    expected = torch.cat([query.repeat_interleave(3), key.repeat_interleave(3), torch.ones(6)])
    torch.testing.assert_close(rows, expected)
    assert row_scales(5, "other.weight", heads, query, key).tolist() == [1.0] * 5


def test_one_process_clip_bounds_the_first_layers_logits_on_the_same_batch() -> None:
    torch.manual_seed(0)
    model = Qwen3(TINY)
    optimizer = lc.Muon(lc.matrix_param_groups(model), lr=0.0, weight_decay=0.0, qk_clip=lc.QKClip(0.05))
    runtime = lc.attach_qk_clip(model, optimizer)
    tokens = torch.randint(64, (2, 16))
    model(tokens).sum().backward()
    optimizer.step()
    before = runtime.maxima[:6].clone()
    assert int(runtime.clipped_heads) > 0 and float(before.max()) > 0.05  # logits of 0.04–0.06
    model(tokens)
    runtime.clip()
    after = runtime.maxima[:6]
    torch.testing.assert_close(
        after, torch.minimum(before, torch.full_like(before, 0.1)), rtol=0, atol=0.1 * 0.5
    )
    assert float(after.max()) <= 0.1 * (1 + 1e-6)
    # Evaluation forwards are not training forwards: nothing is recorded.
    model.eval()
    model(tokens)
    runtime.clip()
    assert float(runtime.max_logit) == -torch.inf and int(runtime.clipped_heads) == 0


def test_transformers_layers_are_found_with_their_biases_and_fused_projections() -> None:
    from transformers import Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from lightning_canzona.qk_clip_runtime import _attention_layers

    shapes = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**shapes, num_attention_heads=6, num_key_value_heads=2))
    ((_, heads),) = _attention_layers(qwen2)
    assert (heads.num_heads, heads.num_kv_heads, heads.head_dim) == (6, 2, 8)
    assert [r.param for r in heads.query] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ]
    phi3 = Phi3ForCausalLM(Phi3Config(**shapes, num_attention_heads=6, num_key_value_heads=2, pad_token_id=0))
    ((_, heads),) = _attention_layers(phi3)
    assert heads.query == (HeadRows("model.layers.0.self_attn.qkv_proj.weight", 0),)
    assert heads.key == (HeadRows("model.layers.0.self_attn.qkv_proj.weight", 48),)


def test_mistakes_are_named() -> None:
    for threshold in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="threshold"):
            lc.QKClip(threshold=threshold)
    with pytest.raises(ValueError, match="alpha"):
        lc.QKClip(alpha=1.5)
    with pytest.raises(TypeError, match=r"QKClip\(threshold=100.0\)"):
        lc.Muon([torch.zeros(2, 2, requires_grad=True)], qk_clip=100.0)
    model = Qwen3(TINY)
    optimizer = lc.NorMuon(lc.matrix_param_groups(model), qk_clip=lc.QKClip())
    with pytest.raises(RuntimeError, match=r"attach_qk_clip\(model, optimizer\)"):
        optimizer.step()
    with pytest.raises(ValueError, match="q_norm, k_norm"):
        lc.attach_qk_clip(Qwen3(Qwen3Config(64, 48, 96, 1, 6, 2, head_dim=8)), optimizer)
    with pytest.raises(ValueError, match="no attention layer in Sequential"):
        lc.attach_qk_clip(nn.Sequential(nn.Linear(4, 4)), optimizer)
