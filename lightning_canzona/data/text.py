"""Byte-level language-modelling data from text that is already on the machine.

The default corpus is the help text that ships with every CPython (``pydoc_data.topics``, ~0.5 MB of
English prose and code under the PSF licence), so nothing is downloaded. Any UTF-8 file can be used
instead with ``text_path``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, RandomSampler

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


class EpochShuffle(RandomSampler):
    """A random order fixed by ``seed`` and the epoch (``set_epoch``, which Lightning calls), as
    ``DistributedSampler``'s is: a run resumed in the middle of an epoch draws the same order.

    In a distributed run Lightning replaces it with its ``DistributedSampler``, shuffled (it is a
    ``RandomSampler``), whose order at one replica is this one.
    """

    def __init__(self, data_source: Dataset, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class ResumableLoader(DataLoader):
    """A ``DataLoader`` that a checkpoint saved in the middle of an epoch resumes where it stopped.

    Lightning saves its ``state_dict`` with the checkpoint and loads it before a resumed run draws
    its first batch (without it, it warns that the loader is "not resumable" and starts the epoch
    over). The state is the epoch of its sampler (which orders each epoch the same way in every
    run: `EpochShuffle`, or Lightning's ``DistributedSampler``) and how many samples the whole
    data-parallel group has drawn in it; the resumed pass over that epoch skips as many, so it
    trains on what the uninterrupted run would have. Resumed at another data-parallel size, the
    count is rounded down to whole batches of the new size (a few samples may come twice).
    """

    _epoch: int | None = None  # the sampler's epoch in the current pass
    _drawn = 0  # batches of the current pass handed out
    _resume: dict[str, Any] | None = None  # a loaded state, for the next pass

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        resume, self._resume = self._resume, None
        epoch = getattr(self.sampler, "epoch", None)  # read here: Lightning sets it before drawing
        same_epoch = resume is not None and epoch is not None and resume["epoch"] == epoch
        skip = resume["samples"] // self._group_batch() if same_epoch else 0
        batches = super().__iter__()
        for _ in range(skip):
            next(batches)
        self._epoch, self._drawn = epoch, skip
        for batch in batches:
            self._drawn += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "samples": self._drawn * self._group_batch()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = state_dict

    def _group_batch(self) -> int:
        """Samples per batch over the data-parallel ranks."""
        return self.batch_size * getattr(self.sampler, "num_replicas", 1)


class ByteTextDataModule(LightningDataModule):
    """Train/validation splits of a byte-level corpus.

    The training loader resumes in the middle of an epoch (`ResumableLoader`): a run resumed from
    any checkpoint trains on the batches the uninterrupted run would have.

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
        # Lightning's DistributedSampler takes the seed of seed_everything from here too.
        order = EpochShuffle(self.train_set, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
        return ResumableLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            sampler=order,
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers
        )
