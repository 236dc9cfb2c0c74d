"""``canzona bench train``: end-to-end training iterations on ``dp × tp`` ranks, canzona against
what users run today (`run`; `measure` trains, `format_table` and `write_chart` report).

Every variant of `VARIANTS` (and `COMPILED` on request) trains the same Qwen3-style model,
composed the same way, from the same initial weights, on the same batches and mesh: the
baselines on Lightning's ``ModelParallelStrategy`` (`BASELINES`), canzona with ``Trainer.fit``,
and canzona in a hand-written Fabric loop (`FABRIC`). The Trainer's callback and the Fabric loop
mark the same points on a `_Clock` (an iteration from its batch in hand to after the optimizer
step); rank 0's medians after the warm-up steps are a `TrainTiming`. docs/benchmarks.md says what
each variant is and the figures measured.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import statistics
import tempfile
import time
from argparse import Namespace
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from lightning import Callback, LightningModule, Trainer
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

import lightning_canzona as lc
from lightning_canzona.compat import REDISTRIBUTE_LOGGER
from lightning_canzona.composition import compose
from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.launcher import InProcessLauncher
from lightning_canzona.models import CausalLanguageModel
from lightning_canzona.tools.bench.devices import check_devices, default_backend, start_method, synchronize
from lightning_canzona.tools.tables import table

#: The Fabric loop's variant: canzona's, in a hand-written loop instead of ``Trainer.fit``.
FABRIC = "canzona (Fabric)"
#: The variants on Lightning's ``ModelParallelStrategy``, which canzona replaces.
BASELINES = ("AdamW", "torch.optim.Muon")
VARIANTS = (*BASELINES, "canzona", FABRIC)
#: The variant with every block compiled (``--compile``).
COMPILED = "canzona (compiled)"
#: Learning rates of the main job (examples/configs/tiny.yaml).
MATRIX_LR, ADAMW_LR, WEIGHT_DECAY = 0.02, 3e-3, 0.01

_T = TypeVar("_T")


@dataclass(frozen=True)
class TrainTiming:
    """Medians over the timed steps of one variant, in milliseconds.

    Attributes:
        name: The variant.
        iteration_ms: Forward, backward and optimizer step.
        optimizer_ms: The optimizer step alone.
        final_loss: Training loss at the last step (same data and weights for every variant).
        first_iteration_ms: The first iteration, not a median: what starting costs (the plan,
            compiling).
    """

    name: str
    iteration_ms: float
    optimizer_ms: float
    final_loss: float
    first_iteration_ms: float = 0.0


class _Setting(NamedTuple):
    """What every variant's run shares: the mesh, the steps and the data.

    A named tuple: Fabric's launcher rebuilds the arguments it hands to the ranks, which a frozen
    dataclass refuses.
    """

    dp: int
    tp: int
    steps: int
    warmup: int
    seq_len: int
    device: str = "cpu"
    backend: str = "gloo"

    @property
    def threads(self) -> int:
        """Intra-op threads per rank: the ranks share the machine's cores."""
        return max(1, (os.cpu_count() or 1) // (self.dp * self.tp))

    @property
    def start_method(self) -> str:
        """How ranks start (`lightning_canzona.tools.bench.devices.start_method`)."""
        return start_method(self.device)

    def datamodule(self) -> ByteTextDataModule:
        """Every variant's data: the same batches in the same order on each rank."""
        return ByteTextDataModule(seq_len=self.seq_len, batch_size=8)


class _Clock:
    """A rank's marks of its iterations, set alike by the Trainer's callback and the Fabric loop
    (rank 0's are reported).

    An iteration runs from its batch in hand to after the optimizer step; the optimizer step,
    from just before the first optimizer steps to the same end. On a GPU (``device``) each mark
    first waits for the work queued before it.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.iterations: list[float] = []
        self.optimizer_steps: list[float] = []
        self._start = self._step_start = 0.0
        self._stepping = False
        self._device = device

    def _now(self) -> float:
        synchronize(torch.device(self._device))
        return time.perf_counter()

    def start_iteration(self) -> None:
        self._start = self._step_start = self._now()
        self._stepping = False

    def start_optimizer_step(self) -> None:
        if not self._stepping:  # the first of possibly several optimizers
            self._step_start, self._stepping = self._now(), True

    def end_iteration(self) -> None:
        end = self._now()
        self.iterations.append(end - self._start)
        self.optimizer_steps.append(end - self._step_start)

    def timing(self, name: str, warmup: int, final_loss: float) -> TrainTiming:
        """The medians of the iterations after the first ``warmup``."""
        return TrainTiming(
            name,
            1e3 * statistics.median(self.iterations[warmup:]),
            1e3 * statistics.median(self.optimizer_steps[warmup:]),
            final_loss,
            1e3 * self.iterations[0],
        )


def _prepare_rank(threads: int) -> None:
    """What every variant's ranks do before they train: the same threads, the same quiet logs."""
    torch.set_num_threads(threads)  # ranks share the cores: the same for every variant
    # torch.optim.Muon on DTensors warns on every redistribution of every step and rank.
    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)


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
    """The main job's model with a constant learning rate, like the baselines; both canzona
    variants train it, the Fabric loop with this same ``configure_optimizers``."""

    def configure_optimizers(self) -> Any:
        groups = lc.matrix_param_groups(self)
        # torch.optim.Muon's dtype, not "auto" (float32 on CPUs without bf16 instructions): the
        # variants compute the same update.
        muon = dict(lr=MATRIX_LR, weight_decay=WEIGHT_DECAY, compute_dtype="bfloat16")
        return lc.Muon(groups, adamw_lr=ADAMW_LR, **muon)


class _InProcessModelParallel(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy``, started from this process like `CanzonaStrategy`."""

    def __init__(self, start_method: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_method = start_method

    def _configure_launcher(self) -> None:
        self._launcher = InProcessLauncher(self, start_method=self.start_method)


class _Timer(Callback):
    """The Trainer's marks on the `_Clock`; at the end, rank 0 writes its `TrainTiming` as JSON."""

    def __init__(self, name: str, path: Path, setting: _Setting) -> None:
        self.name, self.path, self.setting = name, path, setting
        self.clock = _Clock(setting.device)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        _prepare_rank(self.setting.threads)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.clock.start_iteration()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.clock.start_optimizer_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.end_iteration()

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            loss = float(trainer.callback_metrics["train_loss"])
            timing = self.clock.timing(self.name, self.setting.warmup, loss)
            self.path.write_text(json.dumps(asdict(timing)))


class _LastMetrics(Logger):
    """A Fabric logger that keeps the last value of each metric, as the Trainer's
    ``callback_metrics`` does: where ``self.log`` in ``training_step`` goes under Fabric."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "last"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.last.update(metrics)

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        pass  # the Trainer variants keep none either (logger=False)


def _strategy(variant: str, setting: _Setting) -> Any:
    sizes = {"data_parallel_size": setting.dp, "tensor_parallel_size": setting.tp}
    if variant in ("canzona", COMPILED):
        return lc.CanzonaStrategy(
            **sizes,
            process_group_backend=setting.backend,
            start_method=setting.start_method,
            telemetry=False,
            compile=variant == COMPILED,
        )
    return _InProcessModelParallel(setting.start_method, **sizes, process_group_backend=setting.backend)


def _fit_with_trainer(name: str, model: LightningModule, setting: _Setting) -> TrainTiming:
    """``Trainer.fit`` of ``model`` on the variant's strategy; rank 0's timing."""
    # Lightning counts optimizer steps: two optimizers step twice per iteration.
    optimizers_per_iteration = 2 if name == "torch.optim.Muon" else 1
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "timing.json"
        trainer = Trainer(
            accelerator=setting.device,
            devices=setting.dp * setting.tp,
            strategy=_strategy(name, setting),
            max_steps=(setting.warmup + setting.steps) * optimizers_per_iteration,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[_Timer(name, path, setting)],
        )
        trainer.fit(model, datamodule=setting.datamodule())
        return TrainTiming(**json.loads(path.read_text()))


def _fit_with_fabric(name: str, model: LightningModule, setting: _Setting) -> TrainTiming:
    """The Fabric loop (`_train_with_fabric`) on `CanzonaFabricStrategy`; rank 0's timing."""
    strategy = lc.CanzonaFabricStrategy(
        data_parallel_size=setting.dp,
        tensor_parallel_size=setting.tp,
        process_group_backend=setting.backend,
        start_method=setting.start_method,
    )
    fabric = Fabric(
        accelerator=setting.device,
        devices=setting.dp * setting.tp,
        strategy=strategy,
        loggers=_LastMetrics(),
    )
    return fabric.launch(_train_with_fabric, name, model, setting)


def _train_with_fabric(fabric: Fabric, name: str, model: LightningModule, setting: _Setting) -> TrainTiming:
    """On every rank: what ``Trainer.fit`` does for the canzona variant, as a hand-written loop.

    The LightningModule's own ``configure_optimizers`` and ``training_step`` give the Trainer's
    optimizer and loss by construction, and ``training_step``'s ``self.log`` reaches Fabric's
    logger (`_LastMetrics`), from which the final loss is read as the Trainer reads it.
    """
    _prepare_rank(setting.threads)
    model = fabric.setup_module(model)  # before the data: the mesh, which the sampler needs, comes with it
    optimizer = fabric.setup_optimizers(model.configure_optimizers())
    datamodule = setting.datamodule()
    datamodule.setup("fit")
    # The Trainer's sampling: a DistributedSampler over the data-parallel ranks, shuffled with seed 0.
    loader = fabric.setup_dataloaders(datamodule.train_dataloader())
    clock = _Clock(setting.device)
    for index, batch in enumerate(_batches(loader, setting.warmup + setting.steps)):
        clock.start_iteration()
        optimizer.zero_grad()  # where Lightning's closure zeroes them: before the forward
        fabric.backward(model.training_step(batch, index))
        clock.start_optimizer_step()
        optimizer.step()
        clock.end_iteration()
    return clock.timing(name, setting.warmup, fabric.logger.last["train_loss"])


def _batches(loader: Iterable[_T], count: int) -> Iterator[_T]:
    """The first ``count`` batches of ``loader``, epoch after epoch as ``max_steps`` draws them
    (each pass over a Fabric dataloader sets its sampler's epoch, as the Trainer does)."""
    return itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), count)


def measure(
    preset: str = "tiny",
    dp: int = 2,
    tp: int = 2,
    steps: int = 20,
    warmup: int = 5,
    seq_len: int = 128,
    device: str = "cpu",
    backend: str | None = None,
    compiled: bool = False,
) -> list[TrainTiming]:
    """Train every variant (and ``compiled``, `COMPILED`) for ``warmup + steps`` steps on ``dp ×
    tp`` ranks of ``device`` over ``backend`` (``None``: NCCL on GPUs, gloo on CPUs); medians of
    the last ``steps``."""
    backend = backend or default_backend(device)
    problem = check_devices(device, backend, dp * tp)
    if problem:
        raise ValueError(problem)
    setting = _Setting(dp, tp, steps, warmup, seq_len, device, backend)
    results = []
    for variant in (*VARIANTS, COMPILED) if compiled else VARIANTS:
        torch.manual_seed(0)  # the same initial weights for every variant
        model = _BaselineModel(preset, variant) if variant in BASELINES else _CanzonaModel(preset=preset)
        fit = _fit_with_fabric if variant == FABRIC else _fit_with_trainer
        results.append(fit(variant, model, setting))
    return results


def ratios(results: list[TrainTiming]) -> dict[str, float]:
    """canzona's iteration time over each baseline's, and the Fabric loop's and the compiled
    blocks' over the Trainer's."""
    iteration = {r.name: r.iteration_ms for r in results}
    pairs = [("canzona", name) for name in BASELINES] + [(FABRIC, "canzona")]
    pairs += [(COMPILED, "canzona")] if COMPILED in iteration else []
    return {f"{mine} / {theirs}": iteration[mine] / iteration[theirs] for mine, theirs in pairs}


def _ranks(dp: int, tp: int, device: str) -> str:
    return f"{dp * tp} {'GPU' if device == 'cuda' else 'CPU'} ranks"


def format_table(preset: str, dp: int, tp: int, results: list[TrainTiming], device: str = "cpu") -> str:
    rows = [
        [
            r.name,
            f"{r.iteration_ms:.1f}",
            f"{r.optimizer_ms:.1f}",
            f"{r.iteration_ms - r.optimizer_ms:.1f}",
            f"{r.final_loss:.3f}",
            f"{r.first_iteration_ms / 1e3:.2f}",
        ]
        for r in results
    ]
    headers = ["variant", "iteration [ms]", "optimizer [ms]", "fwd+bwd [ms]", "loss", "first [s]"]
    lines = [
        f"{preset}: training iteration on {_ranks(dp, tp, device)} (dp{dp} × tp{tp}), medians",
        table(headers, rows, margin=1),
    ]
    lines.extend(f"{name}: {value:.3f}×" for name, value in ratios(results).items())
    return "\n".join(lines)


def write_chart(path: Path, title: str, results: list[TrainTiming]) -> None:
    """Stacked bars per variant: forward+backward and optimizer step."""
    # Imported here: matplotlib is slow to import and only this command draws.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 1.2 + 0.5 * len(results)))
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
    device: str = "cpu",
    backend: str | None = None,
    compiled: bool = False,
) -> list[TrainTiming]:
    """Measure, print the table, write the JSON and the chart."""
    results = measure(preset, dp, tp, steps, warmup, device=device, backend=backend, compiled=compiled)
    echo(format_table(preset, dp, tp, results, device))
    record = {
        "preset": preset,
        "mesh": {"dp": dp, "tp": tp},
        "device": device,
        "steps": steps,
        "warmup": warmup,
        "results": [asdict(r) for r in results],
        "ratios": ratios(results),
    }
    json_path.write_text(json.dumps(record, indent=2))
    write_chart(chart_path, f"{preset}, dp{dp} × tp{tp}, {_ranks(dp, tp, device)}", results)
    echo(f"wrote {json_path} and {chart_path}")
    return results
