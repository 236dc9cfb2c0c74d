"""Train a Hugging Face ``transformers`` model with CanzonaStrategy: no TP plan, no configure_model.

The model's own tensor-parallel plan and decoder layers are used (see docs/models.md). A tiny
Qwen3, or Qwen3-MoE (random init, nothing downloaded), trains on 4 CPU ranks, data-parallel 2 ×
tensor-parallel 2, on the byte-level corpus that ships with Python::

    python examples/models/transformers_causal_lm.py --max_steps 20
    python examples/models/transformers_causal_lm.py --model qwen3-moe
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import transformers

import lightning_canzona as lc
from lightning_canzona.data import VOCAB_SIZE, ByteTextDataModule


class TransformersCausalLM(L.LightningModule):
    """Any ``AutoModelForCausalLM``, built from its config.

    Args:
        config: The transformers config (use ``from_pretrained`` weights the same way).
        lr: Muon's learning rate; AdamW (embeddings, norms, head) uses ``adamw_lr``.
        adamw_lr: Learning rate of the AdamW parameters.
    """

    def __init__(
        self, config: transformers.PretrainedConfig, lr: float = 0.02, adamw_lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.lr, self.adamw_lr = lr, adamw_lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        # ByteTextDataModule yields seq_len + 1 tokens: the model shifts the labels itself.
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Called on the sharded model: hidden matrices to Muon, the rest to AdamW.
        return lc.Muon(lc.matrix_param_groups(self), lr=self.lr, adamw_lr=self.adamw_lr)


def tiny_qwen3() -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


def tiny_qwen3_moe() -> transformers.Qwen3MoeConfig:
    """Every layer a mixture of 4 experts, 2 per token; each expert split over TP as the model
    declares (the gate and up projections packed in one stack)."""
    config = tiny_qwen3().to_dict()
    return transformers.Qwen3MoeConfig(
        **config, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
    )


CONFIGS = {"qwen3": tiny_qwen3, "qwen3-moe": tiny_qwen3_moe}


def main(model: str, max_steps: int) -> None:
    """Train, and print the last training loss (rank 0)."""
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=lc.CanzonaStrategy(data_parallel_size=2, tensor_parallel_size=2),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(
        TransformersCausalLM(CONFIGS[model]()), datamodule=ByteTextDataModule(seq_len=64, batch_size=8)
    )
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="qwen3")
    parser.add_argument("--max_steps", type=int, default=20)
    arguments = parser.parse_args()
    main(arguments.model, arguments.max_steps)
