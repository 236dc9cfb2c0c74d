"""Runtime telemetry: what the distributed optimizer step costs, logged while training.

`StepTelemetry` collects it from the optimizers and summarizes it over the mesh; with ``Trainer``
the strategy's `OptimizerTelemetry` callback logs it, in a Fabric loop ``fabric.log_dict`` does::

    telemetry = lc.StepTelemetry(optimizer)
    for step in range(steps):
        ...
        optimizer.step()
        telemetry.update()
        if step % 10 == 0:
            fabric.log_dict(telemetry.compute(), step=step)  # every rank calls it
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer
from torchmetrics import CatMetric

from lightning_canzona.compat import should_update_logs
from lightning_canzona.distributed.runtime import StepStats
from lightning_canzona.optim import MatrixOptimizer

#: Logged names; the first two also go to the progress bar.
STEP_MS, IMBALANCE = "canzona/step_ms", "canzona/imbalance"
COMPUTE_MS, COMPUTE_MAX_MS, WAIT_MS, SENT_MIB, MATRICES, DECOMPOSITION_FAILURES, DECOMPOSITION_RETRIES = (
    "canzona/compute_ms",
    "canzona/compute_max_ms",
    "canzona/comm_wait_ms",
    "canzona/sent_MiB",
    "canzona/matrices_per_rank",
    "canzona/decomposition_failures",
    "canzona/decomposition_retries",
)
#: Logged where an optimizer clips query/key heads (`lightning_canzona.QKClip`).
MAX_LOGIT, CLIPPED_HEADS = "canzona/max_logit", "canzona/qk_clipped_heads"


#: What each rank contributes per step, in this order.
_FIGURES: tuple[Callable[[StepStats], float], ...] = (
    lambda stats: stats.step.seconds,
    lambda stats: stats.compute.seconds,
    lambda stats: stats.wait.seconds,
    lambda stats: stats.bytes_sent,
    lambda stats: stats.matrices_computed,
    lambda stats: stats.decomposition_failures,
    lambda stats: stats.decomposition_retries,
)


class StepTelemetry:
    """The cost of every `lightning_canzona` optimizer step, per rank and over the mesh.

    After each optimizer step, `update` keeps every rank's own figures (timed on the device, see
    `lightning_canzona.distributed.runtime.Clock`); `compute` gathers every rank's figures over the steps
    since the last `compute` with a torchmetrics `CatMetric` (a collective: every rank calls it)
    and returns these, means per step:

    - ``canzona/step_ms``: optimizer-step latency of the slowest rank;
    - ``canzona/imbalance``: slowest rank's owner compute over the mean rank's, 1.0 when perfectly
      balanced;
    - ``canzona/compute_ms``, ``canzona/compute_max_ms``: owner compute of the mean and of the
      slowest rank;
    - ``canzona/comm_wait_ms``: time the mean rank was blocked on gathers and scatters, i.e.
      communication the pipeline did not hide;
    - ``canzona/sent_MiB``: bytes sent in all-to-alls by all ranks together;
    - ``canzona/matrices_per_rank``: full-matrix updates computed by the busiest rank;
    - ``canzona/decomposition_failures``: Shampoo/SOAP factor decompositions per step that failed
      (all ranks together); each kept its previous root or basis;
    - ``canzona/decomposition_retries``: Shampoo/SOAP factor decompositions per step that failed
      in float32 and were computed again in float64 (all ranks together), as cuSOLVER needs now
      and then on a rank-deficient factor;
    - with QK-clip (`lightning_canzona.QKClip`), ``canzona/max_logit``: the largest attention logit
      of the steps' training forwards, before clipping, and ``canzona/qk_clipped_heads``: query
      heads clipped per step.

    Args:
        optimizers: The optimizers to follow (as returned by ``fabric.setup_optimizers`` or
            given to it); those that are not `lightning_canzona` optimizers are passed over.
    """

    def __init__(self, optimizers: Optimizer | Iterable[Optimizer]) -> None:
        optimizers = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
        self._optimizers = [o for o in map(_unwrapped, optimizers) if isinstance(o, MatrixOptimizer)]
        #: The latest step's figures; its device timings are read one step later, when the device
        #: has long finished them, so that only a step that computes waits for its own work.
        self._pending: StepStats | None = None
        self._totals = torch.zeros(len(_FIGURES), dtype=torch.float64)  # sums since the last compute
        self._steps = 0
        self._last: list[int] = []
        self._gathered = CatMetric(nan_strategy="error")
        #: QK-clip's figures since the last compute: the same on every rank, kept on the device.
        self._max_logit: torch.Tensor | None = None
        self._clipped_heads: torch.Tensor | None = None

    def update(self) -> None:
        """Keep the latest step's figures: call after each optimizer step (a call without a new
        step, as after a gradient-accumulation micro-batch, keeps nothing)."""
        engines = [engine for optimizer in self._optimizers for engine in optimizer.engines.values()]
        latest = [id(engine.stats) for engine in engines]  # each step gives every engine new stats
        if engines and latest != self._last:
            self._last = latest
            self._read_pending()
            self._pending = StepStats()
            for engine in engines:
                self._pending.add(engine.stats)
            for runtime in (o.qk_clip_runtime for o in self._optimizers if o.qk_clip_runtime is not None):
                self._max_logit = _fold(self._max_logit, runtime.max_logit, torch.maximum)
                self._clipped_heads = _fold(self._clipped_heads, runtime.clipped_heads, torch.add)

    def compute(self) -> dict[str, float]:
        """The figures over the steps since the last call, gathered from every rank (collective);
        empty before the first step."""
        self._read_pending()
        if not self._steps:
            return {}
        device = next(p.device for g in self._optimizers[0].param_groups for p in g["params"])
        self._gathered = self._gathered.to(device)
        self._gathered.update((self._totals / self._steps).to(device)[None])
        self._totals.zero_()
        steps, self._steps = self._steps, 0
        step, compute, wait, sent, matrices, failures, retries = (
            self._gathered.compute().reshape(-1, len(_FIGURES)).unbind(dim=1)
        )
        self._gathered.reset()
        mean_compute = float(compute.mean())
        figures = {
            STEP_MS: 1e3 * float(step.max()),
            IMBALANCE: float(compute.max()) / mean_compute if mean_compute > 0 else 1.0,
            COMPUTE_MS: 1e3 * mean_compute,
            COMPUTE_MAX_MS: 1e3 * float(compute.max()),
            WAIT_MS: 1e3 * float(wait.mean()),
            SENT_MIB: float(sent.sum()) / 2**20,
            MATRICES: float(matrices.max()),
            DECOMPOSITION_FAILURES: float(failures.sum()),
            DECOMPOSITION_RETRIES: float(retries.sum()),
        }
        if self._max_logit is not None and self._clipped_heads is not None:
            figures[MAX_LOGIT] = float(self._max_logit)
            figures[CLIPPED_HEADS] = float(self._clipped_heads) / steps
            self._max_logit = self._clipped_heads = None
        return figures

    def _read_pending(self) -> None:
        if self._pending is not None:
            self._totals += torch.tensor([figure(self._pending) for figure in _FIGURES], dtype=torch.float64)
            self._steps += 1
            self._pending = None


class OptimizerTelemetry(Callback):
    """Logs `StepTelemetry` at Lightning's logging cadence (``Trainer(log_every_n_steps=…)``);
    ``canzona/step_ms`` and ``canzona/imbalance`` also go to the progress bar.

    `CanzonaStrategy` adds this callback unless ``telemetry=False`` or one is already there.
    """

    def __init__(self) -> None:
        self._telemetry: StepTelemetry | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._telemetry = StepTelemetry(trainer.optimizers)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._telemetry is None:
            return
        self._telemetry.update()
        if should_update_logs(trainer):
            for name, value in self._telemetry.compute().items():
                pl_module.log(
                    name, value, prog_bar=name in (STEP_MS, IMBALANCE), on_step=True, on_epoch=False
                )


def _fold(
    total: torch.Tensor | None, value: torch.Tensor, combine: Callable[..., torch.Tensor]
) -> torch.Tensor:
    return value.clone() if total is None else combine(total, value)


def _unwrapped(optimizer: Optimizer) -> Optimizer:
    """The optimizer inside Fabric's (or Lightning's) wrapper of it."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, Optimizer) else optimizer
