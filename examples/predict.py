"""Every prediction of ``trainer.predict`` under ``strategy="canzona"``, gathered in one process.

``trainer.predict`` returns rank 0's share of the predictions, as under DDP (and nothing with
``canzona_notebook``, as with Lightning's ``ddp_notebook``): each data-parallel rank predicts its
own part of the samples, and its tensor-parallel ranks predict the same batches with it.
`SavePredictions` writes each data-parallel rank's part with its samples' indices in the dataset;
`gather_predictions` puts every part back in the dataset's order.

    python examples/predict.py --samples 64                # the bundled model as initialised
    python examples/predict.py --ckpt_path last.ckpt       # as a `canzona fit` run saved it
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from lightning import Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor
from torch.utils.data import DataLoader, Subset

import lightning_canzona  # noqa: F401  (registers strategy="canzona")
from lightning_canzona.data import ByteChunks, load_corpus
from lightning_canzona.models import CausalLanguageModel


# --8<-- [start:gather]
class SavePredictions(BasePredictionWriter):
    """Each data-parallel rank's predictions and their samples' indices, in one file per rank."""

    def __init__(self, folder: str | Path) -> None:
        super().__init__(write_interval="epoch")
        self.folder = Path(folder)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        mesh = pl_module.device_mesh
        if mesh["tensor_parallel"].get_local_rank() == 0:  # the others predicted the same batches
            rank = mesh["data_parallel"].get_local_rank()
            torch.save((predictions, batch_indices[0]), self.folder / f"predictions-{rank}.pt")


def gather_predictions(folder: str | Path) -> list[Tensor]:
    """Every sample's prediction, in the dataset's order, from the files of `SavePredictions`."""
    by_index: dict[int, Tensor] = {}
    for path in Path(folder).glob("predictions-*.pt"):
        predictions, batch_indices = torch.load(path)
        for batch, indices in zip(predictions, batch_indices):
            by_index.update(zip(indices, batch))
    return [by_index[index] for index in range(len(by_index))]


# --8<-- [end:gather]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64, help="sequences of the bundled text to predict")
    parser.add_argument("--seq-len", type=int, default=128, help="bytes a sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences a batch")
    parser.add_argument("--ckpt_path", default=None, help="a checkpoint of the bundled model to predict with")
    args = parser.parse_args()
    samples = Subset(ByteChunks(load_corpus(), args.seq_len), range(args.samples))
    folder = Path(tempfile.gettempdir()) / "lightning_canzona-predictions"
    folder.mkdir(exist_ok=True)
    for earlier in folder.glob("predictions-*.pt"):  # each rank as it starts, before any predicts
        earlier.unlink(missing_ok=True)
    trainer = Trainer(
        strategy="canzona", accelerator="cpu", devices=4, logger=False, callbacks=[SavePredictions(folder)]
    )
    model = CausalLanguageModel("tiny")
    loader = DataLoader(samples, batch_size=args.batch_size)
    trainer.predict(model, loader, ckpt_path=args.ckpt_path, return_predictions=False)
    trainer.strategy.barrier()  # every rank's file is written
    if trainer.is_global_zero:
        logits = torch.stack(gather_predictions(folder))
        targets = torch.stack([samples[index] for index in range(len(samples))])
        accuracy = (logits[:, :-1].argmax(-1) == targets[:, 1:]).float().mean()
        print(f"{len(logits)} sequences predicted; next-byte accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
