"""Training features under CanzonaStrategy: clipping across meshes, accumulation, precision, metrics."""

from __future__ import annotations

import csv
import functools
import sys
from pathlib import Path

import pytest
import torch
import torchmetrics
from lightning import Callback, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from multiprocess import DEVICE, run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.data import DataLoader, Subset
from trainers import quiet_trainer

import lightning_canzona as lc
from lightning_canzona.data import ByteChunks, ByteTextDataModule, load_corpus
from lightning_canzona.distributed.clipping import clip_grad_norm_, total_grad_norm
from lightning_canzona.models import CausalLanguageModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from predict import SavePredictions, gather_predictions  # noqa: E402  (an example, not a package)


def _norm_across_meshes(rank: int, world_size: int) -> None:
    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    generator = torch.Generator().manual_seed(0)
    fulls = [
        torch.randn(8, 6, generator=generator).to(DEVICE),
        torch.randn(10, 4, generator=generator).to(DEVICE),
    ]
    meshes = [(mesh, [Shard(0), Shard(1)]), (mesh["dp"], [Shard(0)])]
    params = []
    for full, (on, placements) in zip(fulls, meshes):
        param = torch.nn.Parameter(
            distribute_tensor(torch.zeros_like(full), on, placements, src_data_rank=None)
        )
        param.grad = distribute_tensor(full, on, placements, src_data_rank=None)
        params.append(param)
    expected = torch.cat([f.flatten() for f in fulls]).norm().cpu()
    torch.testing.assert_close(total_grad_norm(params).cpu(), expected)
    clip_grad_norm_(params, max_norm=1.0)
    torch.testing.assert_close(total_grad_norm(params).cpu(), torch.tensor(1.0), rtol=1e-4, atol=1e-5)


def test_gradient_norm_spans_parameters_on_different_meshes() -> None:
    run_on_ranks(4, _norm_across_meshes)


def _fit(
    tmp_path,
    name,
    callbacks=(),
    model_class=CausalLanguageModel,
    batch_size=4,
    gradient_accumulation="sharded",
    compile=False,
    **trainer_kwargs,
):
    strategy = lc.CanzonaStrategy(
        data_parallel_size=2,
        tensor_parallel_size=2,
        start_method="fork",
        gradient_accumulation=gradient_accumulation,
        compile=compile,
    )
    trainer = quiet_trainer(
        **{"max_steps": 3, "limit_val_batches": 0, **trainer_kwargs},
        callbacks=[*callbacks, SaveFullWeights(tmp_path / f"{name}.pt")],
        strategy=strategy,
    )
    float32_muon = functools.partial(lc.Muon, lr=0.02, adamw_lr=3e-3, compute_dtype="float32")
    torch.manual_seed(0)  # the same initial weights in every run
    module = model_class(preset="tiny", optimizer=float32_muon, warmup_steps=1)
    trainer.fit(module, datamodule=ByteTextDataModule(seq_len=32, batch_size=batch_size))
    return trainer, torch.load(tmp_path / f"{name}.pt")


class SaveFullWeights(Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        full = {name: p.full_tensor() for name, p in pl_module.named_parameters()}
        if trainer.global_rank == 0:
            torch.save({"weights": full, "steps": trainer.global_step}, self.path)


class CheckClipped(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pl_module.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        assert float(total_grad_norm(pl_module.parameters())) <= 0.05 * (1 + 1e-4)


def test_clipping_by_norm_works_on_dp_and_dp_tp_meshes_and_learning_rates_log_by_group(tmp_path) -> None:
    logger = CSVLogger(tmp_path, name="logs", version=0)
    trainer, saved = _fit(
        tmp_path,
        "clipped",
        callbacks=[CheckClipped(), LearningRateMonitor()],
        gradient_clip_val=0.05,
        logger=logger,
        log_every_n_steps=1,
    )
    assert saved["steps"] == 3
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as metrics:
        logged = {name for name in next(csv.reader(metrics)) if name.startswith("lr-")}
    assert logged == {"lr-Muon/muon", "lr-Muon/adamw"}  # the groups by name, not lr-Muon/pg1


class CheckAccumulation(Callback):
    """After a micro-batch that does not step: sharded gradients, or none yet (kept unsharded)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.fit_loop.epoch_loop._should_accumulate():
            grad = pl_module.model.layers[0].mlp.up_proj.weight.grad
            assert (grad is None) == (self.mode == "unsharded")


@pytest.fixture(scope="module")
def large_batches(tmp_path_factory) -> dict:
    """Three steps of batches of 8: what accumulation and manual optimization must equal."""
    return _fit(tmp_path_factory.mktemp("large"), "large", batch_size=8)[1]


def test_accumulation_equals_a_large_batch_and_steps_once_per_window(tmp_path, large_batches) -> None:
    large = large_batches
    for mode in ("sharded", "unsharded"):
        _, accumulated = _fit(
            tmp_path, mode, [CheckAccumulation(mode)], accumulate_grad_batches=2, gradient_accumulation=mode
        )
        assert accumulated["steps"] == large["steps"] == 3
        for name, expected in large["weights"].items():
            torch.testing.assert_close(accumulated["weights"][name], expected, rtol=1e-4, atol=1e-5)


class CheckCompiled(Callback):
    """Each block is compiled, and one graph serves them all."""

    def on_train_start(self, trainer, pl_module) -> None:
        torch._dynamo.utils.counters.clear()  # the ranks' own compiles, not the test process's

    def on_train_end(self, trainer, pl_module) -> None:
        blocks = pl_module.model.layers
        assert all(block._compiled_call_impl is not None for block in blocks)  # nn.Module.compile's
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_compiled_fit_equals_the_eager_one(tmp_path, large_batches) -> None:
    # Every block compiled in place, its forward one graph (fullgraph: FSDP2's gathers and TP's
    # hooks run outside it), traced by dynamo and AOTAutograd and run as their ATen graph
    # (inductor's code generation is the benchmark's: docs/strategy.md#compiling).
    options = {"backend": "aot_eager", "fullgraph": True}
    _, compiled = _fit(tmp_path, "compiled", [CheckCompiled()], batch_size=8, compile=options)
    assert compiled["steps"] == large_batches["steps"] == 3
    for name, expected in large_batches["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], expected, rtol=1e-5, atol=1e-6)


class ManualOptimization(CausalLanguageModel):
    """The same training as `CausalLanguageModel`, with the optimizer driven by hand."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        optimizer.zero_grad()
        loss = self._loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()
        return loss


def test_manual_optimization_steps_exactly_like_automatic(tmp_path, large_batches) -> None:
    automatic = large_batches
    _, manual = _fit(tmp_path, "manual", model_class=ManualOptimization, batch_size=8)
    assert manual["steps"] == automatic["steps"] == 3
    for name, expected in automatic["weights"].items():
        torch.testing.assert_close(manual["weights"][name], expected, rtol=0, atol=0)


class CheckDataParallelReduce(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Mesh (dp=2, tp=2): rank r has dp coordinate r // 2, so its DP group is {r % 2, r % 2 + 2}.
        # Summing over it counts each batch once; over the world, TP replicas would count twice.
        reduced = trainer.strategy.reduce(torch.tensor(float(trainer.global_rank)), reduce_op="sum")
        rank = trainer.global_rank
        assert float(reduced) == float(2 * (rank % 2) + 2), (rank, float(reduced))


class SampleCounting(CausalLanguageModel):
    """Counts training samples with a torchmetrics metric, logged once per epoch."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.samples = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        self.samples.update(torch.tensor(float(batch.shape[0])))
        self.log("samples", self.samples, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_train_and_metrics_reduce_over_data_parallel(tmp_path, precision) -> None:
    trainer, saved = _fit(
        tmp_path, precision, [CheckDataParallelReduce()], SampleCounting, batch_size=4, precision=precision
    )
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert saved["steps"] == 3
    # 3 steps × 4 samples × 2 data-parallel ranks: the 2 tensor-parallel replicas count once.
    assert float(trainer.callback_metrics["samples"]) == 24


def test_every_ranks_predictions_gathered_equal_one_process_and_an_uneven_split_is_refused(tmp_path) -> None:
    # examples/predict.py's writer and gathering, as docs/strategy.md shows them.
    samples = Subset(ByteChunks(load_corpus(), 32), range(12))
    torch.manual_seed(0)
    module = CausalLanguageModel(preset="tiny")
    with torch.no_grad():
        expected = module(torch.stack([samples[index] for index in range(12)]))

    def trainer(**settings) -> Trainer:
        strategy = lc.CanzonaStrategy(data_parallel_size=2, tensor_parallel_size=2, start_method="fork")
        return quiet_trainer(strategy=strategy, **settings)

    loader = DataLoader(samples, batch_size=2)
    trainer(callbacks=[SavePredictions(tmp_path)]).predict(module, loader, return_predictions=False)
    torch.testing.assert_close(torch.stack(gather_predictions(tmp_path)), expected, rtol=1e-5, atol=1e-5)
    # 9 samples: 5 and 4 per data-parallel rank, 3 and 2 batches; the rank with 3 would wait.
    uneven = DataLoader(Subset(samples, range(9)), batch_size=2)
    with pytest.raises(Exception, match=r"different numbers of batches \(9 samples in batches of 2: 3, 2\)"):
        trainer().predict(module, uneven, return_predictions=False)
