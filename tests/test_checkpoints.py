"""Checkpoints under CanzonaStrategy: resuming continues exactly."""

from __future__ import annotations

import functools

import pytest
import torch
from lightning import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_canzona as lc
from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.models import CausalLanguageModel


class RecordLosses(Callback):
    def __init__(self, path) -> None:
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            torch.save(self.losses, self.path)


def _fit(tmp_path, name, ckpt_path=None, distributed=True, mesh=(2, 2)) -> list[float]:
    torch.manual_seed(0)
    # SOAP keeps its factors and eigenbases on each matrix's owner only: the hard case.
    soap = functools.partial(lc.SOAP, lr=3e-3, precondition_frequency=2)
    callbacks = [RecordLosses(tmp_path / f"{name}.pt")]
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=3, save_top_k=-1)
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=mesh[0] * mesh[1],
        strategy=lc.CanzonaStrategy(
            data_parallel_size=mesh[0],
            tensor_parallel_size=mesh[1],
            save_distributed_checkpoint=distributed,
            start_method="spawn",
        ),
        max_steps=6,
        limit_train_batches=3,  # the checkpoint at step 3 ends an epoch: both runs see the same data
        limit_val_batches=0,
        logger=False,
        default_root_dir=tmp_path,
        enable_checkpointing=ckpt_path is None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    module = CausalLanguageModel(preset="tiny", optimizer=soap, warmup_steps=1)
    trainer.fit(module, datamodule=ByteTextDataModule(seq_len=32, batch_size=4), ckpt_path=ckpt_path)
    return torch.load(tmp_path / f"{name}.pt")


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "single-file"])
def test_checkpoint_resumes_exactly_at_the_same_mesh(tmp_path, distributed) -> None:
    uninterrupted = _fit(tmp_path, "uninterrupted", distributed=distributed)
    checkpoint = tmp_path / "checkpoints" / "epoch=0-step=3.ckpt"
    # Distributed: one shard file per rank in a folder. Single file: every owner's state in one.
    assert checkpoint.is_dir() == distributed
    resumed = _fit(tmp_path, "resumed", ckpt_path=str(checkpoint), distributed=distributed)
    assert len(resumed) == 3
    # The next three losses: the first checks the weights, the next two the optimizer state
    # (owner-held SOAP factors and bases, sharded moments) and the learning-rate schedule.
    for got, expected in zip(resumed, uninterrupted[3:]):
        assert abs(got - expected) <= 1e-6, (resumed, uninterrupted[3:])
