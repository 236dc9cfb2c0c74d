"""The README's headline, ``Trainer(strategy="canzona", devices=4)``, as a user's script."""

from __future__ import annotations

HEADLINE = """
import lightning as L
import lightning_canzona
from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.models import CausalLanguageModel

class Fails(CausalLanguageModel):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("the loss went wrong on every rank")

class Misspelt(CausalLanguageModel):
    def configure_optimizers(self):  # docs/index.md's pattern, with a typo
        groups = lightning_canzona.matrix_param_groups(self)
        return lightning_canzona.Muon(groups, lr=0.02, wieght_decay=0.01)

trainer = L.Trainer(
    strategy={strategy}, devices={devices}, accelerator="cpu", max_steps=2, limit_val_batches=0,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit({model}("tiny"), ByteTextDataModule(seq_len=32, batch_size=4){fit})
"""


def headline(
    strategy: str = '"canzona"', devices: int = 4, model: str = "CausalLanguageModel", fit: str = ""
) -> str:
    """The script's text: `HEADLINE` with the Trainer's ``strategy`` and ``devices`` (Python
    expressions), the ``model`` class it fits (the bundled model, or one of the mistakes above)
    and more of ``trainer.fit``'s arguments (``fit``: ``", ckpt_path=..."``)."""
    return HEADLINE.format(strategy=strategy, devices=devices, model=model, fit=fit)
