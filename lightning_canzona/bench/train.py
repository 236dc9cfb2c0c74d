"""End-to-end training iterations on ``dp × tp`` CPU ranks: canzona against what users run today.

Every variant is a real ``Trainer.fit`` of the same Qwen3-style model, composed the same way (TP
plan, then FSDP2 per block), from the same initial weights, on the same data and mesh:

- ``AdamW``: Lightning's ``ModelParallelStrategy`` with ``torch.optim.AdamW`` (the elementwise
  baseline: no matrix optimizer at all);
- ``torch.optim.Muon``: Lightning's ``ModelParallelStrategy`` with ``torch.optim.Muon`` for the
  matrices and ``torch.optim.AdamW`` for the rest (exact, but every rank computes every update
  on DTensors);
- ``canzona``: `CanzonaStrategy` with `lightning_canzona.Muon`.

An iteration is ``on_train_batch_start`` to ``on_train_batch_end`` on rank 0 (forward, backward,
optimizer step; the ranks meet in collectives every step, so rank 0 waits for the slowest); the
optimizer step is the part after ``on_before_optimizer_step``. Medians exclude warm-up steps.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

import lightning_canzona as lc
from lightning_canzona.compat import REDISTRIBUTE_LOGGER
from lightning_canzona.composition import compose
from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.launcher import InProcessLauncher
from lightning_canzona.models import CausalLanguageModel

VARIANTS = ("AdamW", "torch.optim.Muon", "canzona")
#: Learning rates of the main job (examples/configs/tiny.yaml).
MATRIX_LR, ADAMW_LR, WEIGHT_DECAY = 0.02, 3e-3, 0.01


@dataclass(frozen=True)
class TrainTiming:
    """Medians over the timed steps of one variant, in milliseconds.

    Attributes:
        name: The variant.
        iteration_ms: Forward, backward and optimizer step.
        optimizer_ms: The optimizer step alone.
        final_loss: Training loss at the last step (same data and weights for every variant).
    """

    name: str
    iteration_ms: float
    optimizer_ms: float
    final_loss: float


class _BaselineModel(CausalLanguageModel):
    """The main job's model for ``ModelParallelStrategy``, which composes nothing itself.

    ``configure_model`` composes it exactly as `CanzonaStrategy` does. With ``torch.optim.Muon``
    Lightning needs manual optimization: Muon takes only matrices, so AdamW is a second optimizer.
    """

    def __init__(self, preset: str, optimizer_name: str) -> None:
        super().__init__(preset=preset)
        self.optimizer_name = optimizer_name
        self.automatic_optimization = optimizer_name != "torch.optim.Muon"

    def configure_model(self) -> None:
        if not any(isinstance(p, DTensor) for p in self.parameters()):
            compose(self, self.device_mesh)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "AdamW":
            return torch.optim.AdamW(self.parameters(), lr=ADAMW_LR, weight_decay=WEIGHT_DECAY)
        groups = lc.matrix_param_groups(self)
        matrices = [p for g in groups if "algorithm" not in g for _, p in g["params"]]
        others = [p for g in groups if g.get("algorithm") == "adamw" for _, p in g["params"]]
        return [
            torch.optim.Muon(matrices, lr=MATRIX_LR, weight_decay=WEIGHT_DECAY),
            torch.optim.AdamW(others, lr=ADAMW_LR, weight_decay=WEIGHT_DECAY),
        ]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = self._loss(batch)
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        self.log("train_loss", loss)
        return loss


class _CanzonaModel(CausalLanguageModel):
    """The main job's model with a constant learning rate, like the baselines."""

    def configure_optimizers(self) -> Any:
        groups = lc.matrix_param_groups(self)
        return lc.Muon(groups, lr=MATRIX_LR, adamw_lr=ADAMW_LR, weight_decay=WEIGHT_DECAY)


class _SpawnedModelParallel(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy``, started from this process like `CanzonaStrategy`."""

    def _configure_launcher(self) -> None:
        self._launcher = InProcessLauncher(self, start_method="spawn")


class _Timer(Callback):
    """Times every iteration and its optimizer step on rank 0; writes them as JSON at the end."""

    def __init__(self, path: Path, threads: int) -> None:
        self.path, self.threads = path, threads
        self.iterations: list[float] = []
        self.optimizer_steps: list[float] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        torch.set_num_threads(self.threads)  # ranks share the cores: the same for every variant
        # torch.optim.Muon on DTensors warns on every redistribution of every step and rank.
        logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = self.step_start = time.perf_counter()
        self.stepping = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.stepping:  # the first of possibly several optimizers
            self.step_start, self.stepping = time.perf_counter(), True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        end = time.perf_counter()
        self.iterations.append(end - self.start)
        self.optimizer_steps.append(end - self.step_start)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            loss = float(trainer.callback_metrics["train_loss"])
            record = {"iterations": self.iterations, "optimizer_steps": self.optimizer_steps, "loss": loss}
            self.path.write_text(json.dumps(record))


def _strategy(variant: str, dp: int, tp: int) -> Any:
    if variant == "canzona":
        return lc.CanzonaStrategy(
            data_parallel_size=dp, tensor_parallel_size=tp, start_method="spawn", telemetry=False
        )
    return _SpawnedModelParallel(data_parallel_size=dp, tensor_parallel_size=tp)


def measure(
    preset: str = "tiny", dp: int = 2, tp: int = 2, steps: int = 20, warmup: int = 5, seq_len: int = 128
) -> list[TrainTiming]:
    """Fit every variant for ``warmup + steps`` steps; medians of the last ``steps``."""
    threads = max(1, (os.cpu_count() or 1) // (dp * tp))
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for variant in VARIANTS:
            path = Path(directory) / "timing.json"
            torch.manual_seed(0)  # the same initial weights for every variant
            model = _CanzonaModel(preset=preset) if variant == "canzona" else _BaselineModel(preset, variant)
            # Lightning counts optimizer steps: two optimizers step twice per iteration.
            optimizers_per_iteration = 2 if variant == "torch.optim.Muon" else 1
            trainer = Trainer(
                accelerator="cpu",
                devices=dp * tp,
                strategy=_strategy(variant, dp, tp),
                max_steps=(warmup + steps) * optimizers_per_iteration,
                limit_val_batches=0,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[_Timer(path, threads)],
            )
            trainer.fit(model, datamodule=ByteTextDataModule(seq_len=seq_len, batch_size=8))
            record = json.loads(path.read_text())
            results.append(
                TrainTiming(
                    variant,
                    1e3 * statistics.median(record["iterations"][warmup:]),
                    1e3 * statistics.median(record["optimizer_steps"][warmup:]),
                    record["loss"],
                )
            )
    return results


def ratios(results: list[TrainTiming]) -> dict[str, float]:
    """canzona's iteration time over each alternative's."""
    by_name = {r.name: r for r in results}
    canzona = by_name["canzona"].iteration_ms
    return {
        f"canzona / {name}": canzona / by_name[name].iteration_ms for name in VARIANTS if name != "canzona"
    }


def format_table(preset: str, dp: int, tp: int, results: list[TrainTiming]) -> str:
    lines = [
        f"{preset}: training iteration on {dp * tp} CPU ranks (dp{dp} × tp{tp}), medians",
        f"{'variant':>18} {'iteration [ms]':>15} {'optimizer [ms]':>15} {'fwd+bwd [ms]':>13} {'loss':>7}",
    ]
    for r in results:
        lines.append(
            f"{r.name:>18} {r.iteration_ms:>15.1f} {r.optimizer_ms:>15.1f} "
            f"{r.iteration_ms - r.optimizer_ms:>13.1f} {r.final_loss:>7.3f}"
        )
    lines.extend(f"{name}: {value:.3f}×" for name, value in ratios(results).items())
    return "\n".join(lines)


def write_chart(path: Path, title: str, results: list[TrainTiming]) -> None:
    """Stacked bars per variant: forward+backward and optimizer step."""
    # Imported here: matplotlib is slow to import and only this command draws.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 2.8))
    names = [r.name for r in results]
    forward_backward = [r.iteration_ms - r.optimizer_ms for r in results]
    axis.barh(names, forward_backward, color="tab:gray", label="forward + backward")
    axis.barh(
        names,
        [r.optimizer_ms for r in results],
        left=forward_backward,
        color="tab:blue",
        label="optimizer step",
    )
    axis.set_xlabel("median iteration [ms]")
    axis.invert_yaxis()
    axis.legend(fontsize=8, loc="lower right")
    axis.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(
    preset: str,
    dp: int,
    tp: int,
    steps: int,
    warmup: int,
    json_path: Path,
    chart_path: Path,
    echo: Callable[[str], None] = print,
) -> list[TrainTiming]:
    """Measure, print the table, write the JSON and the chart."""
    results = measure(preset, dp, tp, steps, warmup)
    echo(format_table(preset, dp, tp, results))
    record = {
        "preset": preset,
        "mesh": {"dp": dp, "tp": tp},
        "steps": steps,
        "warmup": warmup,
        "results": [asdict(r) for r in results],
        "ratios": ratios(results),
    }
    json_path.write_text(json.dumps(record, indent=2))
    write_chart(chart_path, f"{preset}, dp{dp} × tp{tp}, {dp * tp} CPU ranks", results)
    echo(f"wrote {json_path} and {chart_path}")
    return results
