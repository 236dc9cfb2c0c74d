"""Example data: a byte-level text corpus that needs no download."""

from lightning_canzona.data.text import VOCAB_SIZE, ByteChunks, ByteTextDataModule, load_corpus

__all__ = ["VOCAB_SIZE", "ByteChunks", "ByteTextDataModule", "load_corpus"]
