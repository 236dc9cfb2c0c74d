"""A fine-tune from pretrained weights, exported to what other tools read, and read back.

The bundled model: trained at dp2 x tp2, its distributed checkpoint exported by ``canzona export``
to one safetensors file of whole tensors, which a new model loads and fine-tunes from. A
transformers model: loaded with ``from_pretrained`` from a local folder, fine-tuned from its
pretrained weights, exported to a folder that ``from_pretrained`` loads in a fresh process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning import Callback, LightningModule, Trainer
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import lightning_canzona as lc
from lightning_canzona.models import CausalLanguageModel

BATCH, SEQ = 4, 32
OPTIMIZER = functools.partial(lc.Muon, lr=0.02, adamw_lr=3e-3, compute_dtype="float32")


def _batches(count: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(vocab, (count * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))


class FirstLossAndCheckpoint(Callback):
    """Rank 0 keeps the first step's loss; at the end every rank saves a distributed checkpoint."""

    def __init__(self, folder) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1 and trainer.global_rank == 0:
            torch.save(outputs["loss"].detach(), self.folder / "first_loss.pt")

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.folder / "trained.ckpt")


def _fit(module: LightningModule, folder, steps: int, vocab: int = 256) -> float:
    """Fit at dp2 x tp2 (the same batches on every rank); the first step's loss."""
    trainer = Trainer(
        accelerator="cpu",
        devices=4,
        strategy=lc.CanzonaStrategy(start_method="fork"),  # "auto": dp2 x tp2 for 2 key/value heads
        max_steps=steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FirstLossAndCheckpoint(folder)],
    )
    trainer.fit(module, DataLoader(_batches(steps, vocab), batch_size=BATCH))
    return float(torch.load(folder / "first_loss.pt"))


def test_the_bundled_model_exported_and_fine_tuned_from_its_export(tmp_path) -> None:
    torch.manual_seed(0)
    trained = CausalLanguageModel("tiny", optimizer=OPTIMIZER)
    _fit(trained, tmp_path, steps=2)
    exported = tmp_path / "tiny.safetensors"
    command = ["canzona", "export", str(tmp_path / "trained.ckpt"), str(exported)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    weights = load_file(exported)
    # Every parameter once, whole: the weights the ranks trained (handed back to this process).
    assert weights.keys() == trained.state_dict().keys()
    for name, tensor in trained.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    # A new model starts from the export; its first step under the strategy sees its weights intact.
    tuned = CausalLanguageModel("tiny", optimizer=OPTIMIZER)
    tuned.load_state_dict(weights)
    expected = float(tuned._loss(_batches(1)[:BATCH]))
    assert _fit(tuned, tmp_path, steps=1) == pytest.approx(expected, rel=1e-6)


class Pretrained(LightningModule):
    """A transformers causal LM fine-tuned from pretrained weights in a local folder."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return OPTIMIZER(lc.matrix_param_groups(self))


def test_a_pretrained_transformers_model_fine_tuned_and_exported_for_from_pretrained(tmp_path) -> None:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    module = Pretrained(str(tmp_path / "base"))
    batch = _batches(1, vocab=128)[:BATCH]
    with torch.no_grad():
        expected = float(module.training_step(batch, 0))  # the pretrained weights on one process
    assert _fit(module, tmp_path, steps=2, vocab=128) == pytest.approx(expected, rel=1e-6)

    # As a user exports it: the command, with the training config's model.
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model:\n  class_path: test_export.Pretrained\n  init_args:\n    folder: {tmp_path / 'base'}\n"
    )
    exported = tmp_path / "tuned"
    command = ["canzona", "export", str(tmp_path / "trained.ckpt"), str(exported), "--format", "transformers"]
    tests = str(Path(__file__).parent)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [*command, "--config", str(config)], capture_output=True, text=True, timeout=120, env=environment
    )
    assert done.returncode == 0, done.stderr[-2000:]
    torch.save(batch, tmp_path / "batch.pt")
    script = textwrap.dedent(
        f"""
        import torch, transformers
        model = transformers.AutoModelForCausalLM.from_pretrained({str(exported)!r})
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
        batch = torch.load({str(tmp_path / "batch.pt")!r})
        torch.save(model(input_ids=batch).logits, {str(tmp_path / "logits.pt")!r})
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with torch.no_grad():
        logits = module.model(input_ids=batch).logits  # the fine-tuned weights, handed back
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), logits, rtol=1e-6, atol=1e-6)


def test_the_command_builds_the_module_of_a_training_config_without_weights() -> None:
    from lightning_canzona.export import _module_from_config

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.yaml"
    module = _module_from_config(str(config))
    assert isinstance(module, CausalLanguageModel) and next(module.parameters()).is_meta
    with pytest.raises(ValueError, match=r"format must be one of \('safetensors', 'torch', 'transformers'\)"):
        lc.export_checkpoint(config, "out", "onnx")
    with pytest.raises(ValueError, match=r"needs the module that holds one transformers model"):
        lc.export_checkpoint(config, "out", "transformers", module)
