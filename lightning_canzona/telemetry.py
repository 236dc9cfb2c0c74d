"""Runtime telemetry: what the distributed optimizer step costs, logged while training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import CatMetric

from lightning_canzona.compat import should_update_logs
from lightning_canzona.distributed.runtime import StepStats
from lightning_canzona.optim import MatrixOptimizer

#: Logged names; the first two also go to the progress bar.
STEP_MS, IMBALANCE = "canzona/step_ms", "canzona/imbalance"
COMPUTE_MS, COMPUTE_MAX_MS, WAIT_MS, SENT_MIB, MATRICES, DECOMPOSITION_FAILURES = (
    "canzona/compute_ms",
    "canzona/compute_max_ms",
    "canzona/comm_wait_ms",
    "canzona/sent_MiB",
    "canzona/matrices_per_rank",
    "canzona/decomposition_failures",
)


#: What each rank contributes per step, in this order.
_FIGURES: tuple[Callable[[StepStats], float], ...] = (
    lambda stats: stats.step.seconds,
    lambda stats: stats.compute.seconds,
    lambda stats: stats.wait.seconds,
    lambda stats: stats.bytes_sent,
    lambda stats: stats.matrices_computed,
    lambda stats: stats.decomposition_failures,
)


class OptimizerTelemetry(Callback):
    """Logs the cost of every `lightning_canzona` optimizer step, per rank and over the mesh.

    Each optimizer step, every rank keeps its own figures (timed on the device, see
    `lightning_canzona.distributed.clock`). At Lightning's logging cadence
    (``Trainer(log_every_n_steps=…)``) a torchmetrics `CatMetric` gathers every rank's figures
    over the steps since the last log, and these are logged (means are per step):

    - ``canzona/step_ms``: optimizer-step latency of the slowest rank (progress bar);
    - ``canzona/imbalance``: slowest rank's owner compute over the mean rank's, 1.0 when perfectly
      balanced (progress bar);
    - ``canzona/compute_ms``, ``canzona/compute_max_ms``: owner compute of the mean and of the
      slowest rank;
    - ``canzona/comm_wait_ms``: time the mean rank was blocked on gathers and scatters, i.e.
      communication the pipeline did not hide;
    - ``canzona/sent_MiB``: bytes sent in all-to-alls by all ranks together;
    - ``canzona/matrices_per_rank``: full-matrix updates computed by the busiest rank;
    - ``canzona/decomposition_failures``: Shampoo/SOAP factor decompositions per step that failed
      (all ranks together); each kept its previous root or basis.

    `CanzonaStrategy` adds this callback unless ``telemetry=False`` or one is already there.
    """

    def __init__(self) -> None:
        #: The latest step's figures; its device timings are read one step later, when the device
        #: has long finished them, so that only a logging step waits for its own step's work.
        self._pending: StepStats | None = None
        self._totals = torch.zeros(len(_FIGURES), dtype=torch.float64)  # sums since the last log
        self._steps = 0
        self._last: list[int] = []
        self._gathered = CatMetric(nan_strategy="error")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engines = [
            e for o in trainer.optimizers if isinstance(o, MatrixOptimizer) for e in o.engines.values()
        ]
        if not engines:
            return
        # Each optimizer step gives every engine new stats; a gradient-accumulation micro-batch not.
        latest = [id(engine.stats) for engine in engines]
        if latest != self._last:
            self._last = latest
            self._read_pending()
            self._pending = StepStats()
            for engine in engines:
                self._pending.add(engine.stats)
        if should_update_logs(trainer):
            self._read_pending()
            if self._steps:
                for name, value in self._summarize(pl_module.device).items():
                    pl_module.log(
                        name, value, prog_bar=name in (STEP_MS, IMBALANCE), on_step=True, on_epoch=False
                    )

    def _read_pending(self) -> None:
        if self._pending is not None:
            self._totals += torch.tensor([figure(self._pending) for figure in _FIGURES], dtype=torch.float64)
            self._steps += 1
            self._pending = None

    def _summarize(self, device: torch.device) -> dict[str, float]:
        """Every rank's per-step means since the last log, gathered (collective)."""
        self._gathered = self._gathered.to(device)
        self._gathered.update((self._totals / self._steps).to(device)[None])
        self._totals.zero_()
        self._steps = 0
        step, compute, wait, sent, matrices, failures = (
            self._gathered.compute().reshape(-1, len(_FIGURES)).unbind(dim=1)
        )
        self._gathered.reset()
        mean_compute = float(compute.mean())
        return {
            STEP_MS: 1e3 * float(step.max()),
            IMBALANCE: float(compute.max()) / mean_compute if mean_compute > 0 else 1.0,
            COMPUTE_MS: 1e3 * mean_compute,
            COMPUTE_MAX_MS: 1e3 * float(compute.max()),
            WAIT_MS: 1e3 * float(wait.mean()),
            SENT_MIB: float(sent.sum()) / 2**20,
            MATRICES: float(matrices.max()),
            DECOMPOSITION_FAILURES: float(failures.sum()),
        }
