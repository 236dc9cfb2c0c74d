import pytest
import torch
from torch.utils.data import DistributedSampler
from trainers import quiet_trainer

import lightning_canzona as lc
from lightning_canzona.data import ByteChunks, ByteTextDataModule, load_corpus
from lightning_canzona.data.text import ResumableLoader
from lightning_canzona.models import PRESETS, CausalLanguageModel, Qwen3


@pytest.mark.parametrize(
    "preset, billions",
    [
        ("0.6B", 0.6),
        ("1.7B", 1.7),
        ("4B", 4.0),
        ("8B", 8.2),
        ("14B", 14.8),
        ("32B", 32.8),
        ("30B-A3B", 30.5),
        ("235B-A22B", 235.1),
    ],
)
def test_real_presets_build_on_the_meta_device_with_their_published_sizes(preset, billions) -> None:
    with torch.device("meta"):
        model = Qwen3(preset)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert sum(unique.values()) / 1e9 == pytest.approx(billions, rel=0.05)


def test_tiny_decoder_is_causal_and_uses_grouped_query_attention() -> None:
    model = Qwen3("tiny").eval()
    config = PRESETS["tiny"]
    assert model.layers[0].self_attn.k_proj.out_features == config.num_key_value_heads * config.head_dim
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])  # no peeking ahead
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_tied_presets_share_the_embedding_with_the_head() -> None:
    with torch.device("meta"):
        model = Qwen3("0.6B")
    assert model.lm_head.weight is model.embed_tokens.weight
    groups = lc.matrix_param_groups(model)
    assert all("embed" not in name and "lm_head" not in name for name, _ in groups[0]["params"])


def test_byte_corpus_ships_with_python_and_chunks_into_shifted_windows(tmp_path) -> None:
    corpus = load_corpus()
    assert corpus.numel() > 200_000 and corpus.dtype == torch.uint8
    chunks = ByteChunks(corpus, seq_len=32)
    assert chunks[1][0] == corpus[32] and chunks[1].shape == (33,)
    path = tmp_path / "text.txt"
    path.write_text("héllo " * 20)
    assert bytes(load_corpus(path).tolist()).decode() == "héllo " * 20
    with pytest.raises(ValueError, match="cannot fill one window"):
        ByteChunks(load_corpus(path), seq_len=1000)


def _loaders(dataset, replicas: int, epoch: int) -> list[ResumableLoader]:
    """The training loaders of ``replicas`` data-parallel ranks, as Lightning makes them."""
    loaders = []
    for rank in range(replicas):
        order = DistributedSampler(dataset, replicas, rank, shuffle=True, seed=0)
        order.set_epoch(epoch)
        loaders.append(ResumableLoader(dataset, batch_size=4, sampler=order, drop_last=True))
    return loaders


def test_the_training_loader_resumes_where_the_checkpoint_stopped_at_any_data_parallel_size() -> None:
    data = ByteTextDataModule(seq_len=32, batch_size=4)
    data.setup("fit")
    one = data.train_dataloader()  # in one process: one replica's order
    one.sampler.set_epoch(1)
    assert torch.equal(next(iter(one)), next(iter(_loaders(data.train_set, 1, epoch=1)[0])))
    # Three batches on each of two ranks in epoch 1, then a checkpoint: 24 samples drawn.
    samples = list(range(50))
    saved = _loaders(samples, 2, epoch=1)
    assert saved[0].state_dict() == {"epoch": None, "samples": 0}
    ranks = [iter(loader) for loader in saved]
    drawn = [int(i) for _ in range(3) for rank in ranks for i in next(rank)]
    assert saved[0].state_dict() == {"epoch": 1, "samples": 24} == saved[1].state_dict()
    # Resumed on one rank: the rest of epoch 1, no sample twice (48: whole batches of 50); in
    # epoch 2 (a checkpoint at the end of epoch 1), the whole epoch.
    for epoch, before in ((1, drawn), (2, [])):
        (resumed,) = _loaders(samples, 1, epoch)
        resumed.load_state_dict(saved[0].state_dict())
        seen = before + [int(i) for batch in resumed for i in batch]
        assert len(set(seen)) == len(seen) == 48, (epoch, seen)


def test_language_model_trains_through_a_lightning_trainer_and_resumes_its_schedule(tmp_path) -> None:
    data = ByteTextDataModule(seq_len=32, batch_size=4)
    module = CausalLanguageModel(preset="tiny", warmup_steps=2)
    trainer = quiet_trainer(devices=1, max_steps=4, limit_val_batches=2, val_check_interval=2)
    trainer.fit(module, datamodule=data)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, lc.Muon)
    assert [group["algorithm"] for group in optimizer.param_groups] == ["muon", "adamw"]
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    trainer.save_checkpoint(tmp_path / "four.ckpt")
    # Resumed into a longer run: the schedule of the run it resumes (10% after its step 4), said once.
    longer = quiet_trainer(devices=1, max_steps=6, limit_val_batches=0)
    with pytest.warns(UserWarning, match=r"decays over 4 steps, and this run trains for 6") as warned:
        longer.fit(
            CausalLanguageModel(preset="tiny", warmup_steps=2),
            datamodule=data,
            ckpt_path=tmp_path / "four.ckpt",
        )
    assert len([w for w in warned if "learning-rate schedule" in str(w.message)]) == 1
    assert longer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(0.02 * 0.1)


def test_mixture_of_experts_routes_each_token_to_its_top_k_experts() -> None:
    torch.manual_seed(0)
    model = Qwen3("tiny-moe")
    moe = model.layers[0].mlp
    x = torch.randn(3, 5, PRESETS["tiny-moe"].hidden_size)
    tokens = x.reshape(-1, x.shape[-1])
    # The same result token by token, with the experts' SwiGLUs written out.
    probabilities = torch.softmax(moe.router(tokens), dim=-1)
    expected = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        weights, chosen = probabilities[t].topk(moe.top_k)
        for weight, e in zip(weights / weights.sum(), chosen.tolist()):
            gate, up = (moe.experts.gate_up_proj[e] @ tokens[t]).chunk(2)
            expected[t] += weight * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe(x).reshape(-1, x.shape[-1]), expected, rtol=1e-5, atol=1e-6)
    assert moe.balance_loss.ndim == 0 and 0 < float(moe.balance_loss) < moe.experts.down_proj.shape[0]
    groups = lc.matrix_param_groups(model)
    matrices = {name for group in groups if "algorithm" not in group for name, _ in group["params"]}
    assert "layers.0.mlp.experts.gate_up_proj" in matrices and "layers.0.mlp.router.weight" not in matrices
    # Gate rows, then up rows (the chunk above): each expert's halves are updated as two matrices.
    assert {
        name: group["row_blocks"] for group in groups for name, _ in group["params"] if "row_blocks" in group
    } == {
        f"layers.{layer}.mlp.experts.gate_up_proj": 2
        for layer in range(PRESETS["tiny-moe"].num_hidden_layers)
    }
