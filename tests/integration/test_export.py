"""A fine-tune from pretrained weights, exported to what other tools read, and read back.

The bundled model: trained at dp2 x tp2, its distributed checkpoint exported by ``canzona export``
to one safetensors file of whole tensors, which a new model loads and fine-tunes from. A
transformers model: loaded with ``from_pretrained`` from a local folder, fine-tuned from its
pretrained weights, exported to a folder that ``from_pretrained`` loads in a fresh process.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from lightning import Callback, LightningModule, Trainer
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import lightning_canzona as lc
from lightning_canzona.cli import main
from lightning_canzona.models import CausalLanguageModel

BATCH, SEQ = 4, 32
TINY_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.yaml"
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


@pytest.fixture(scope="module")
def bundled(tmp_path_factory) -> tuple[Path, CausalLanguageModel]:
    """The bundled model trained 2 steps at dp2 x tp2 (its weights handed back), and the folder of
    its distributed checkpoint ``trained.ckpt``."""
    folder = tmp_path_factory.mktemp("bundled")
    torch.manual_seed(0)
    trained = CausalLanguageModel("tiny", optimizer=OPTIMIZER)
    _fit(trained, folder, steps=2)
    return folder, trained


def test_the_bundled_model_exported_and_fine_tuned_from_its_export(bundled, tmp_path) -> None:
    folder, trained = bundled
    exported = tmp_path / "tiny.safetensors"
    # The command in this process (the transformers test below runs it as its own process).
    main(["export", str(folder / "trained.ckpt"), str(exported)])
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(exported.stat().st_mode) == 0o666 & ~umask  # as any file created (not 0600)
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


def _export(*arguments: object) -> str:
    """``canzona export`` in this process, expected to fail: the one line it printed."""
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(io.StringIO()) as printed:
        main(["export", *map(str, arguments)])
    assert exited.value.code == 2
    (line,) = printed.getvalue().splitlines()
    return line


def test_the_command_says_in_one_line_what_to_pass(bundled, tmp_path) -> None:
    checkpoint = bundled[0] / "trained.ckpt"
    # A Trainer checkpoint of a module that no config built: nothing names its class.
    line = _export(checkpoint, tmp_path / "hf", "--format", "transformers")
    assert line.startswith(f"canzona export: error: Exporting {checkpoint} as a transformers folder needs ")
    assert "pass --config with its training config, or in Python lc.export_checkpoint(" in line
    assert "module=model) with the LightningModule or the transformers model." in line
    # And, in the same line, what to do with a model that is none (the bundled one's case).
    assert line.endswith(
        "A model that is not a transformers model (the bundled Qwen3 among them) has no such "
        "folder: export it as one file, --format safetensors (the default) or --format torch."
    )
    # The bundled model is no transformers model, whichever way it is given.
    line = _export(checkpoint, tmp_path / "hf", "--format", "transformers", "--config", TINY_CONFIG)
    assert line == (
        "canzona export: error: CausalLanguageModel holds no transformers model, so there is no "
        "transformers folder to write: export the checkpoint as one file, format='safetensors' "
        "(the default) or 'torch' (--format safetensors, --format torch)."
    )
    line = _export(checkpoint, tmp_path / "model.safetensors", "--model-key", "model")
    assert line == (
        f"canzona export: error: The checkpoint {checkpoint} holds no model under 'model': its model "
        "is under 'state_dict': pass model_key='state_dict' (--model-key state_dict) or none."
    )
    assert not (tmp_path / "hf").exists() and not (tmp_path / "model.safetensors").exists()


def test_a_checkpoint_of_several_models_is_exported_by_the_key_of_one(tmp_path) -> None:
    # fabric.save of a state with two models (a teacher and a student), in its single-file layout.
    student, teacher = torch.nn.Linear(2, 3), torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(student.parameters())
    checkpoint = tmp_path / "distilled.ckpt"
    state = {"student": student.state_dict(), "teacher": teacher.state_dict(), "step": 1}
    torch.save({**state, "optimizer": optimizer.state_dict()}, checkpoint)
    with pytest.raises(
        ValueError, match=r"holds several models: it holds models under \['student', 'teacher'\]"
    ):
        lc.export_checkpoint(checkpoint, tmp_path / "model.safetensors")
    lc.export_checkpoint(checkpoint, tmp_path / "teacher.safetensors", model_key="teacher")
    assert load_file(tmp_path / "teacher.safetensors").keys() == teacher.state_dict().keys()


class Pretrained(LightningModule):
    """A transformers causal LM fine-tuned from pretrained weights in a local folder."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        import transformers

        self.save_hyperparameters()  # built by the CLI: with its class path
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return OPTIMIZER(lc.matrix_param_groups(self))


def test_a_pretrained_transformers_model_fine_tuned_and_exported_for_from_pretrained(tmp_path) -> None:
    import transformers

    from lightning_canzona.cli import CanzonaCLI

    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    # As `canzona fit --model test_export.Pretrained --model.folder base` builds it.
    arguments = ["--model", "test_export.Pretrained", "--model.folder", str(tmp_path / "base")]
    module = CanzonaCLI(subclass_mode_model=True, args=arguments, run=False).model
    batch = _batches(1, vocab=128)[:BATCH]
    with torch.no_grad():
        expected = float(module.training_step(batch, 0))  # the pretrained weights on one process
    assert _fit(module, tmp_path, steps=2, vocab=128) == pytest.approx(expected, rel=1e-6)

    # As a user exports it: the command, which builds the module its hyperparameters name.
    exported = tmp_path / "tuned"
    command = ["canzona", "export", str(tmp_path / "trained.ckpt"), str(exported), "--format", "transformers"]
    tests = str(Path(__file__).parent)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        "building test_export.Pretrained from the checkpoint's hyperparameters" in done.stdout + done.stderr
    )
    # Given the transformers model itself, found in the checkpoint under the LightningModule's `model.`.
    own = lc.export_checkpoint(tmp_path / "trained.ckpt", tmp_path / "own", "transformers", module.model)
    # Both by transformers' own names, the tied head stored once, as its save_pretrained writes them.
    names = load_file(tmp_path / "base" / "model.safetensors").keys()
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert load_file(exported / "model.safetensors").keys() == names
    assert load_file(own / "model.safetensors").keys() == names
    assert stat.S_IMODE((exported / "model.safetensors").stat().st_mode) == stat.S_IMODE(
        (exported / "config.json").stat().st_mode
    )  # readable as the config beside it
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()  # tied
    with torch.no_grad():
        logits = module.model(input_ids=batch).logits  # the fine-tuned weights, handed back
        torch.testing.assert_close(reloaded(input_ids=batch).logits, logits, rtol=1e-6, atol=1e-6)


def test_the_command_builds_the_module_of_a_training_config_without_weights() -> None:
    from lightning_canzona.export import module_from_config

    module = module_from_config(str(TINY_CONFIG))
    assert isinstance(module, CausalLanguageModel) and next(module.parameters()).is_meta
    with pytest.raises(ValueError, match=r"format must be one of \('safetensors', 'torch', 'transformers'\)"):
        lc.export_checkpoint(TINY_CONFIG, "out", "onnx")
