"""Byte-level language-modelling data from text that is already on the machine.

The default corpus is the help text that ships with every CPython (``pydoc_data.topics``, ~0.5 MB of
English prose and code under the PSF licence), so nothing is downloaded. Any UTF-8 file can be used
instead with ``text_path``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

#: Byte-level vocabulary: one token per byte value.
VOCAB_SIZE = 256


def load_corpus(text_path: str | Path | None = None) -> Tensor:
    """The corpus as a 1-D ``uint8`` tensor of UTF-8 bytes."""
    if text_path is not None:
        data = Path(text_path).read_bytes()
    else:
        try:
            from pydoc_data.topics import topics
        except ImportError as error:  # some distributions strip it
            raise RuntimeError(
                "This Python has no pydoc_data module to use as the default corpus; "
                "pass text_path=<a UTF-8 text file>."
            ) from error
        data = "\n\n".join(topics[key] for key in sorted(topics)).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteChunks(Dataset):
    """Consecutive, non-overlapping windows of ``seq_len + 1`` bytes (inputs and shifted targets)."""

    def __init__(self, data: Tensor, seq_len: int) -> None:
        if data.numel() < seq_len + 1:
            raise ValueError(f"{data.numel()} bytes cannot fill one window of seq_len + 1 = {seq_len + 1}")
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> Tensor:
        start = index * self.seq_len
        return self.data[start : start + self.seq_len + 1].long()


class ByteTextDataModule(LightningDataModule):
    """Train/validation splits of a byte-level corpus.

    Args:
        seq_len: Tokens (bytes) per training sequence.
        batch_size: Sequences per batch on each data-parallel rank.
        text_path: A UTF-8 text file; ``None`` uses the help text bundled with Python.
        val_fraction: Share of the corpus (its end) held out for validation.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 16,
        text_path: str | None = None,
        val_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        corpus = load_corpus(self.hparams.text_path)
        split = int(corpus.numel() * (1.0 - self.hparams.val_fraction))
        self.train_set = ByteChunks(corpus[:split], self.hparams.seq_len)
        self.val_set = ByteChunks(corpus[split:], self.hparams.seq_len)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.hparams.num_workers,
        )
