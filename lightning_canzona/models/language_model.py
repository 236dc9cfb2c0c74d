"""The LightningModule that trains a `lightning_canzona.models.Qwen3` as a causal LM."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from lightning import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.optim.lr_scheduler import LambdaLR

from lightning_canzona.models.qwen3 import (
    Qwen3,
    resolve_config,
    tensor_parallel_constraints,
    tensor_parallel_plan,
)
from lightning_canzona.optim import MatrixOptimizer, Muon, matrix_param_groups


class CausalLanguageModel(LightningModule):
    """Next-token prediction with a Qwen3-style decoder.

    Args:
        preset: A preset name of `lightning_canzona.models.qwen3.PRESETS` (``"tiny"`` and
            ``"tiny-moe"`` train on a CPU; the others are the real Qwen3 shapes). A
            mixture-of-experts preset adds the routers' load-balancing loss to the training loss.
        optimizer: Builds the optimizer from param groups (``matrix_param_groups`` of the decoder);
            ``None`` uses ``lightning_canzona.Muon(lr=0.02, adamw_lr=3e-3, weight_decay=0.01)``.
        warmup_steps: Linear learning-rate warm-up, then cosine decay to 10% at the last step
            (`WarmupCosine`; a resumed run keeps the schedule of the run it resumes, and says so
            when its length differs).
        qk_norm: RMS-normalise each head's queries and keys, as Qwen3 does; ``False`` builds the
            attention without (Llama-style), whose logits an optimizer's ``qk_clip`` bounds.
    """

    def __init__(
        self,
        preset: str = "tiny",
        optimizer: OptimizerCallable | None = None,
        warmup_steps: int = 20,
        qk_norm: bool = True,
    ) -> None:
        super().__init__()
        # Checked here, in the launching process, not on every rank later.
        if isinstance(optimizer, functools.partial):
            if _is_matrix_optimizer(optimizer.func):
                optimizer.func.check_keywords(optimizer.keywords)
            if optimizer.keywords.get("qk_clip") is not None and qk_norm:
                raise ValueError(
                    "The optimizer's qk_clip bounds attention logits through the scale of the query "
                    "and key weights, which QK-norm takes away. Set qk_norm=False on the model "
                    "(model.init_args.qk_norm: false) or leave qk_clip unset."
                )
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer
        self.model = Qwen3(replace(resolve_config(preset), qk_norm=qk_norm))

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """The decoder's TP plan, named from this module (what `CanzonaStrategy` applies)."""
        return {f"model.{name}": style for name, style in tensor_parallel_plan(self.model).items()}

    def tensor_parallel_constraints(self) -> dict[str, int]:
        """The head counts and widths that a tensor-parallel size must divide (what
        `CanzonaStrategy`'s ``"auto"`` sizes and its checks read)."""
        return tensor_parallel_constraints(self.model.config)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    @torch.no_grad()
    def generate(self, prompt: str, max_new_bytes: int = 80, temperature: float = 0.0, seed: int = 0) -> str:
        """Continue ``prompt`` byte by byte (the bundled models read UTF-8 bytes), in this process.

        Args:
            prompt: The text to continue.
            max_new_bytes: How many bytes to add.
            temperature: 0 takes the likeliest byte each time; above 0 samples from the
                softmax at that temperature, with ``seed``.
            seed: The sampling's random seed.

        Returns:
            The prompt and its continuation, decoded (invalid UTF-8 replaced).
        """
        device = next(self.parameters()).device
        tokens = torch.tensor(list(prompt.encode()), dtype=torch.long, device=device)[None]
        generator = torch.Generator(device=device).manual_seed(seed)
        for _ in range(max_new_bytes):
            logits = self.model(tokens)[0, -1].float()
            if temperature > 0:
                probabilities = torch.softmax(logits / temperature, dim=-1)
                following = torch.multinomial(probabilities, 1, generator=generator)
            else:
                following = logits.argmax().view(1)
            tokens = torch.cat([tokens, following.view(1, 1)], dim=1)
        return bytes(tokens[0].tolist()).decode(errors="replace")

    def _loss(self, batch: Tensor) -> Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        if self.model.config.num_experts:
            balance = self.model.balance_loss()
            self.log("balance_loss", balance)
            return loss + self.model.config.router_aux_loss_coef * balance
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        groups = matrix_param_groups(self.model)
        if self.optimizer_factory is None:
            optimizer = Muon(groups, lr=0.02, adamw_lr=3e-3, weight_decay=0.01)
        else:
            optimizer = self.optimizer_factory(groups)
        schedule = WarmupCosine(self.hparams.warmup_steps, self._training_steps())
        scheduler = LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        """Say so when a resumed run is longer or shorter than the schedule it restored."""
        scheduler = self.lr_schedulers()
        schedule = getattr(scheduler, "lr_lambdas", [None])[0]
        steps = self._training_steps()
        if isinstance(schedule, WarmupCosine) and schedule.total_steps != steps:
            rank_zero_warn(
                f"The learning-rate schedule restored from the checkpoint decays over "
                f"{schedule.total_steps} steps, and this run trains for {steps} (trainer.max_steps): it "
                f"keeps the checkpoint's schedule, so after step {schedule.total_steps} the learning "
                "rate stays at 10% of its peak (CanzonaStrategy(load_optimizer_state=False) would "
                "start the optimizer afresh, with a new warm-up).",
                category=UserWarning,
            )

    def _training_steps(self) -> int:
        return max(1, int(self.trainer.estimated_stepping_batches))


@dataclass
class WarmupCosine:
    """The bundled model's learning-rate factor per step: a linear warm-up over ``warmup_steps``,
    then a cosine decay to 10% at ``total_steps``.

    A callable object rather than a function, so that ``LambdaLR`` saves its fields with its state:
    a resumed run keeps the schedule it started with.
    """

    warmup_steps: int
    total_steps: int

    def __call__(self, step: int) -> float:
        warmup = min(self.warmup_steps, self.total_steps)
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _is_matrix_optimizer(factory: Any) -> bool:
    return isinstance(factory, type) and issubclass(factory, MatrixOptimizer)
