"""Train your own ``nn.Module`` with CanzonaStrategy, sharding it yourself in ``configure_model``.

A small decoder written in plain PyTorch (no transformers, no plan declared) trains on 4 CPU ranks,
data-parallel 2 × tensor-parallel 2, on the byte-level corpus that ships with Python::

    python examples/models/own_model.py --max_steps 20

``configure_model`` receives the strategy's mesh as ``self.device_mesh`` (dimensions
``data_parallel`` and ``tensor_parallel``), applies torch's tensor-parallel styles to each block and
wraps each block, then the whole model, with FSDP2. The optimizer is built afterwards, on the
sharded parameters: canzona plans every matrix over all ranks, whatever their layout.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_canzona as lc
from lightning_canzona.data import VOCAB_SIZE, ByteTextDataModule


class Block(nn.Module):
    """Causal self-attention and a gated feed-forward, each behind an RMS norm and a residual.

    Written to run on a tensor-parallel rank as well: the number of heads is read from the
    (possibly split) projection, never stored.
    """

    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.attention_norm = nn.RMSNorm(width)
        self.query, self.key, self.value = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.out = nn.Linear(width, width, bias=False)
        self.feed_forward_norm = nn.RMSNorm(width)
        self.gate, self.up = (nn.Linear(width, 4 * width, bias=False) for _ in range(2))
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.attention_norm(x)
        q, k, v = (
            p(h).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
            for p in (self.query, self.key, self.value)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).flatten(2))
        h = self.feed_forward_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class OwnLanguageModel(L.LightningModule):
    """A byte-level decoder that shards itself.

    Args:
        width: Hidden size.
        depth: Number of blocks.
        head_dim: Size of each attention head (``width / head_dim`` heads, split over TP).
        lr: Muon's learning rate; ``adamw_lr`` for the embedding, norms and head.
        adamw_lr: Learning rate of the AdamW parameters.
    """

    def __init__(
        self, width: int = 64, depth: int = 2, head_dim: int = 16, lr: float = 0.02, adamw_lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.lr, self.adamw_lr = lr, adamw_lr
        self.embedding = nn.Embedding(VOCAB_SIZE, width)
        self.blocks = nn.ModuleList(Block(width, head_dim) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, VOCAB_SIZE, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def configure_model(self) -> None:
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        plan = {
            # Heads and feed-forward columns are split over TP; the outputs are summed back.
            **{name: ColwiseParallel() for name in ("query", "key", "value", "gate", "up")},
            **{name: RowwiseParallel() for name in ("out", "down")},
        }
        for block in self.blocks:
            parallelize_module(block, tp_mesh, plan)
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self, mesh=dp_mesh)  # the embedding, the final norm and the head

    def loss(self, batch: Tensor) -> Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten().long())

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Called after configure_model: the groups hold the sharded parameters.
        return lc.Muon(lc.matrix_param_groups(self), lr=self.lr, adamw_lr=self.adamw_lr)


def main(max_steps: int) -> None:
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
    trainer.fit(OwnLanguageModel(), datamodule=ByteTextDataModule(seq_len=64, batch_size=8))
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=20)
    main(parser.parse_args().max_steps)
