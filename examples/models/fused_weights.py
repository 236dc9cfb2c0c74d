"""Fused weights, updated block by block: a fused QKV (grouped-query attention) and a fused gate/up.

Muon orthogonalises the Q, K and V blocks of the fused ``qkv`` projection, and the gate and up
halves of ``gate_up``, each as the matrix it would be on its own (``row_blocks``, see
docs/models.md). ``--per_head`` splits Q and K further into one block per head. A tiny decoder
(random init, nothing downloaded) trains on 2 CPU ranks with FSDP2, which cuts ``qkv``'s rows
across its blocks: each matrix's owner gathers it whole and splits it there, so the split costs no
extra collective::

    python examples/models/fused_weights.py --max_steps 20 --per_head
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import lightning_canzona as lc
from lightning_canzona.data import VOCAB_SIZE, ByteTextDataModule

WIDTH, HEADS, KV_HEADS, HEAD_DIM, INNER = 48, 6, 2, 8, 96


class FusedBlock(nn.Module):
    """Pre-norm decoder block whose attention and MLP projections are fused, as many models store
    them: ``qkv`` holds Q's rows, then K's, then V's; ``gate_up`` the gate's rows, then up's."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
        self.attn_norm, self.mlp_norm = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, sum(self.rows), bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)
        self.gate_up = nn.Linear(WIDTH, 2 * INNER, bias=False)
        self.down = nn.Linear(INNER, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (
            t.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
            for t in self.qkv(self.attn_norm(x)).split(self.rows, dim=-1)
        )
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, length, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class FusedDecoder(L.LightningModule):
    """A byte-level decoder of `FusedBlock`s.

    Args:
        per_head: One block per head for Q and K (V stays one matrix); else Q, K and V.
        lr: Muon's learning rate; AdamW (embedding, norms, head) uses ``adamw_lr``.
        adamw_lr: Learning rate of the AdamW parameters.
    """

    def __init__(self, per_head: bool = False, lr: float = 0.02, adamw_lr: float = 3e-3) -> None:
        super().__init__()
        self.per_head, self.lr, self.adamw_lr = per_head, lr, adamw_lr
        self.embed = nn.Embedding(VOCAB_SIZE, WIDTH)
        self.blocks = nn.ModuleList(FusedBlock() for _ in range(2))
        self.norm = nn.RMSNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB_SIZE, bias=False)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(batch[:, :-1])
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.lm_head(self.norm(hidden))
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        q_rows, k_rows, v_rows = self.blocks[0].rows
        if self.per_head:  # one block of HEAD_DIM rows per Q and K head, then V whole
            qkv = (HEAD_DIM,) * (HEADS + KV_HEADS) + (v_rows,)
        else:
            qkv = (q_rows, k_rows, v_rows)
        row_blocks = {"blocks.*.qkv.weight": qkv, "blocks.*.gate_up.weight": 2}
        groups = lc.matrix_param_groups(self, row_blocks=row_blocks)
        return lc.Muon(groups, lr=self.lr, adamw_lr=self.adamw_lr)


def main(max_steps: int, per_head: bool) -> None:
    """Train, and print the last training loss (rank 0)."""
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lc.CanzonaStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(FusedDecoder(per_head), datamodule=ByteTextDataModule(seq_len=64, batch_size=8))
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--per_head", action="store_true", help="split Q and K per head")
    arguments = parser.parse_args()
    main(arguments.max_steps, arguments.per_head)
