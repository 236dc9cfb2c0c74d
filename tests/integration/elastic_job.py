"""A training job as a user runs it on several nodes with ``torchrun --max-restarts``, which can
lose a node: ``torchrun … elastic_job.py FOLDER NUM_NODES DEVICES``.

It trains the bundled model for `STEPS` steps, saves a distributed checkpoint every 2 steps
(``last.ckpt`` the latest) and the weights, whole, to ``FOLDER/weights-{step}.pt``, and resumes from
``last`` when restarted. With ``LOSE_A_NODE=1`` in the environment, node 1 (torchrun's
``GROUP_RANK``) is lost twice: in the first attempt its ranks SIGKILL themselves while the job
saves the step-4 checkpoint; in the second, in the middle of step 5 (gradients computed, the
optimizer's collectives about to start), one of them SIGKILLs every process of the node, its
torchrun agent included, so that the job goes on with the nodes left (``--nnodes 1:2``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_canzona as lc
from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.models import CausalLanguageModel

STEPS = 6


class LoseNodeOne(Callback):
    """Node 1 lost: its ranks mid-save in the first attempt, the whole node mid-step in the second."""

    @staticmethod
    def _attempt(trainer: L.Trainer) -> int | None:
        on_node_one = os.environ.get("GROUP_RANK") == "1" and trainer.global_step == 4
        return int(os.environ["TORCHELASTIC_RESTART_COUNT"]) if on_node_one else None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self._attempt(trainer) == 0:
            print(
                f"node 1 lost: rank {trainer.global_rank} killed while saving the step-4 checkpoint",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._attempt(trainer) == 1:
            print("node 1 lost in step 5, its agent with it", flush=True)
            os.killpg(0, signal.SIGKILL)


class SaveWeights(Callback):
    """Says at which step each attempt starts; writes the weights, whole, from rank 0 at each
    checkpoint's step."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer, pl_module) -> None:
        print(f"rank {trainer.global_rank} starts at step {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % 2 == 0:
            weights = {name: p.full_tensor() for name, p in pl_module.named_parameters()}
            if trainer.global_rank == 0:
                torch.save(weights, self.folder / f"weights-{trainer.global_step}.pt")


def main(
    folder: Path,
    num_nodes: int,
    devices: int,
    ckpt_path: str | None = "last",
    checkpoints: bool = True,
    **strategy,
) -> None:
    """Train (or resume) in ``folder``, saving checkpoints or not (a reference run);
    ``strategy``: `CanzonaStrategy`'s keywords."""
    folder.mkdir(exist_ok=True)
    L.seed_everything(0)
    callbacks: list[Callback] = [SaveWeights(folder)]
    if checkpoints:
        every_2_steps = {"every_n_train_steps": 2, "save_top_k": -1, "save_last": True}
        callbacks.append(ModelCheckpoint(dirpath=folder / "checkpoints", **every_2_steps))
    if os.environ.get("LOSE_A_NODE") == "1":
        callbacks.append(LoseNodeOne())
    trainer = L.Trainer(
        strategy=lc.CanzonaStrategy(**strategy),
        num_nodes=num_nodes,
        devices=devices,
        accelerator="cpu",
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        enable_checkpointing=checkpoints,
    )
    model = CausalLanguageModel("tiny")
    trainer.fit(model, ByteTextDataModule(seq_len=32, batch_size=4), ckpt_path=ckpt_path)
    print(f"rank {trainer.global_rank} ended at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
