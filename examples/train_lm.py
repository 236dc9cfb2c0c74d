"""Train the tiny Qwen3-style byte-level language model with ``lightning_canzona.Muon``.

One process on a CPU, a few minutes, on the help text that ships with Python::

    python examples/train_lm.py --max-steps 300
"""

from __future__ import annotations

import argparse

import torch
from lightning import Trainer, seed_everything

from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.models import CausalLanguageModel


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--text-path", default=None, help="a UTF-8 text file (default: Python's help text)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op CPU threads")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    seed_everything(0)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        val_check_interval=100,
        limit_val_batches=20,
        log_every_n_steps=10,
        enable_checkpointing=False,
        logger=False,
    )
    data = ByteTextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, text_path=args.text_path)
    trainer.fit(CausalLanguageModel(preset="tiny"), datamodule=data)
    print(f"final train_loss={float(trainer.callback_metrics['train_loss']):.3f}")


if __name__ == "__main__":
    main()
