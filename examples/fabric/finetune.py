"""Fine-tune a Hugging Face ``transformers`` model with a hand-written Lightning Fabric loop.

    python examples/fabric/finetune.py     # a tiny Qwen3 built here stands in for a pretrained model
    python examples/fabric/finetune.py --base path/to/model --text my_corpus.txt --steps 200

The model comes from ``from_pretrained`` (with no ``--base``, a tiny random Qwen3 is saved to
``runs/finetune/base/`` first: nothing is downloaded). ``Fabric(strategy="canzona")`` splits it
with its own tensor-parallel plan and FSDP2 on the mesh it chooses, and Muon updates every weight
matrix once, on one owner. The loop evaluates the held-out loss before and after, saves a
distributed checkpoint (``runs/finetune/checkpoint/``), and exports it as a folder that
``from_pretrained`` loads (``runs/finetune/tuned/``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import lightning_canzona as lc
from lightning_canzona.data.text import VOCAB_SIZE, ByteChunks, load_corpus


def stand_in_base(folder: Path) -> Path:
    """A tiny random Qwen3 saved as a pretrained model would be (byte vocabulary, tied head)."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def fine_tuning_text(text: str | None) -> torch.Tensor:
    """The corpus to fine-tune on: ``text``'s bytes, or the sources of Python's ``json`` package."""
    if text is not None:
        return load_corpus(text)
    sources = sorted(Path(json.__file__).parent.glob("*.py"))
    return torch.frombuffer(bytearray(b"\n\n".join(p.read_bytes() for p in sources)), dtype=torch.uint8)


@torch.no_grad()
def held_out_loss(fabric: Fabric, model: torch.nn.Module, loader: DataLoader) -> float:
    """The mean loss over the held-out batches of every rank."""
    model.eval()
    losses = [model(input_ids=tokens.long(), labels=tokens.long()).loss for tokens in loader]
    model.train()
    return float(fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None, help="a from_pretrained folder (default: a tiny stand-in)")
    parser.add_argument(
        "--text", default=None, help="a text file to fine-tune on (default: Python's json sources)"
    )
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", default="runs/finetune", help="the run's folder: base/, checkpoint/, tuned/")
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="canzona")
    fabric.launch(fine_tune, args)


def fine_tune(fabric: Fabric, args: argparse.Namespace) -> None:
    """What every rank runs: fine-tune, evaluate, save and export."""
    out = Path(args.out)
    transformers.utils.logging.disable_progress_bar()  # one bar per rank for every load and save
    fabric.seed_everything(0, verbose=False)
    base = Path(args.base or out / "base")
    with fabric.rank_zero_first():  # rank 0 writes the stand-in; the others then read it
        if args.base is None and not (base / "config.json").is_file():
            stand_in_base(base)
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
    model = fabric.setup_module(model)  # the mesh is chosen for the model: set it up first
    optimizer = fabric.setup_optimizers(lc.Muon(lc.matrix_param_groups(model), lr=0.02, adamw_lr=3e-3))

    windows = ByteChunks(fine_tuning_text(args.text), args.seq_len)
    held_out = len(windows) // 10
    train, validation = torch.utils.data.random_split(
        windows, [len(windows) - held_out, held_out], generator=torch.Generator().manual_seed(0)
    )
    train_loader, validation_loader = fabric.setup_dataloaders(
        DataLoader(train, batch_size=8, shuffle=True), DataLoader(validation, batch_size=8)
    )
    before = held_out_loss(fabric, model, validation_loader)

    step, batches = 0, iter(train_loader)
    while step < args.steps:
        tokens = next(batches, None)
        if tokens is None:  # a new epoch
            batches = iter(train_loader)
            tokens = next(batches)
        loss = model(input_ids=tokens.long(), labels=tokens.long()).loss
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
    after = held_out_loss(fabric, model, validation_loader)
    fabric.print(f"held-out loss: {before:.3f} before, {after:.3f} after {step} steps")

    fabric.save(out / "checkpoint", {"model": model, "optimizer": optimizer, "step": step})
    if fabric.global_rank == 0:  # one process reads every shard into a from_pretrained folder
        with torch.device("meta"):  # the model's class and config, without weights or shards
            blank = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(base)
            )
        tuned = lc.export_checkpoint(
            out / "checkpoint", out / "tuned", "transformers", blank, model_key="model"
        )
        fabric.print(f"exported: transformers.AutoModelForCausalLM.from_pretrained('{tuned}')")
    fabric.barrier()


if __name__ == "__main__":
    main()
