"""`Trainer(strategy="canzona")`: registration, composition, optimizer binding, CLI, bad input."""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from headline import headline
from lightning import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf
from printed import warning_lines
from scripts import run_script
from torch.distributed.tensor import DTensor
from trainers import quiet_trainer

import lightning_canzona as lc
from lightning_canzona.cli import CanzonaCLI, main
from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.models import CausalLanguageModel

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = ROOT / "examples" / "configs" / "tiny.yaml"


def _trainer(strategy, callbacks=(), **kwargs) -> Trainer:
    return quiet_trainer(
        **{"max_steps": 4, "limit_val_batches": 0, **kwargs}, strategy=strategy, callbacks=list(callbacks)
    )


def test_import_registers_the_strategies_once() -> None:
    assert StrategyRegistry["canzona"]["strategy"] is lc.CanzonaStrategy
    assert StrategyRegistry["canzona_notebook"]["init_params"] == {"start_method": "fork"}
    importlib.reload(lc)  # registering again is a no-op, not an error
    trainer = Trainer(strategy="canzona", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, lc.CanzonaStrategy)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: _trainer(lc.CanzonaStrategy(tensor_parallel_size=3)),
            r"tensor_parallel_size=3 does not divide the 4",
        ),
        (
            lambda: _trainer(lc.CanzonaStrategy(data_parallel_size=0)),
            r"data_parallel_size=0 does not divide the 4",
        ),
        (
            lambda: _trainer(lc.CanzonaStrategy(), precision="16-true"),
            r"precision='16-true' is not supported",
        ),
        (lambda: lc.CanzonaStrategy(plan=lc.PlanConfig(policy="greedy")), r"policy must be one of"),
        (
            lambda: lc.CanzonaStrategy(compile={"mod": "max-autotune"}),
            r"compile=\{'mod': 'max-autotune'\}: torch\.compile takes no 'mod'; it takes fullgraph, .*mode",
        ),
    ],
)
def test_bad_settings_fail_before_any_process_starts(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def _same_on_every_rank(tensor: torch.Tensor) -> bool:
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, tensor.detach().cpu())
    return all(torch.equal(theirs, everyone[0]) for theirs in everyone)


class WithRootParameter(CausalLanguageModel):
    """A parameter set on the LightningModule itself, which FSDP2 cannot manage."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.loss_scale = torch.nn.Parameter(torch.ones(()))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.loss_scale

    def configure_optimizers(self):
        return lc.Muon(lc.matrix_param_groups(self), lr=0.02, adamw_lr=0.01)


class CheckComposition(Callback):
    """Runs on every rank: the model is sharded over both meshes and the optimizer is bound."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != 1:
            return
        q_proj = pl_module.model.layers[0].self_attn.q_proj.weight
        assert isinstance(q_proj, DTensor) and q_proj.device_mesh.ndim == 2  # TP then FSDP2
        assert isinstance(pl_module.model.embed_tokens.weight, DTensor)  # FSDP2 over the DP mesh
        # Its gradient differs per data-parallel rank: averaged, the replicas stay equal.
        assert _same_on_every_rank(pl_module.loss_scale) and pl_module.loss_scale != 1
        optimizer = trainer.optimizers[0]
        assert isinstance(optimizer, lc.Muon) and optimizer.plan_config.policy == "lpt"
        engine = optimizer.engines[q_proj.device_mesh]
        assert engine.plan is not None and engine.stats.all_to_alls == 2 * len(engine.plan.micro_groups)
        # QK-norm weights serve every head while each TP rank holds only its heads: their
        # gradients must be summed over TP, or the replicas drift apart after the first step.
        q_norm = pl_module.model.layers[0].self_attn.q_norm.weight.full_tensor()
        everyone = [None] * trainer.world_size
        torch.distributed.all_gather_object(everyone, q_norm)
        assert all(torch.equal(theirs, q_norm) for theirs in everyone)
        assert not torch.equal(q_norm, torch.ones_like(q_norm))  # it was trained


def test_fit_composes_tp_and_fsdp2_and_binds_the_plan_settings() -> None:
    module = WithRootParameter(preset="tiny", warmup_steps=1)
    strategy = lc.CanzonaStrategy(
        data_parallel_size=2, tensor_parallel_size=2, plan=lc.PlanConfig(policy="lpt"), start_method="fork"
    )
    trainer = _trainer(strategy, callbacks=[CheckComposition()])
    trainer.fit(module, datamodule=ByteTextDataModule(seq_len=32, batch_size=4))
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


class OwnComposition(CausalLanguageModel):
    """Keeps full control: TP on the blocks only, FSDP2 on the blocks only, the rest replicated."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        plan = {k: v for k, v in self.tensor_parallel_plan().items() if k.startswith("model.layers")}
        parallelize_module(self, self.device_mesh["tensor_parallel"], plan)
        for block in self.model.layers:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])


class CheckOwnComposition(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        q_proj = pl_module.model.layers[0].self_attn.q_proj.weight
        assert isinstance(q_proj, DTensor) and q_proj.device_mesh.ndim == 2
        # The strategy composed nothing on top: what the module left alone stays a plain tensor,
        # whose gradient the strategy averages over data parallelism: replicas stay equal.
        embedding = pl_module.model.embed_tokens.weight
        assert not isinstance(embedding, DTensor) and _same_on_every_rank(embedding)
        assert trainer.optimizers[0].engines[q_proj.device_mesh].stats.matrices_computed > 0


def test_a_module_that_overrides_configure_model_keeps_full_control() -> None:
    strategy = lc.CanzonaStrategy(data_parallel_size=2, tensor_parallel_size=2, start_method="fork")
    trainer = _trainer(strategy, callbacks=[CheckOwnComposition()], max_steps=2)
    trainer.fit(OwnComposition(preset="tiny"), datamodule=ByteTextDataModule(seq_len=32, batch_size=4))
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


class TorchMuonModel(CausalLanguageModel):
    def configure_optimizers(self):
        # One group spanning both meshes: the embedding (DP mesh) and the blocks (DP×TP mesh).
        matrices = [p for p in self.model.parameters() if p.ndim == 2]
        optimizer = torch.optim.Muon(matrices, lr=0.03, momentum=0.9, nesterov=False, ns_steps=4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class CheckConversion(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0]
        assert isinstance(optimizer, lc.Muon)
        (group,) = optimizer.param_groups  # the user's one group, spanning two meshes
        assert len({p.device_mesh for p in group["params"]}) == 2
        assert (group["momentum"], group["nesterov"], group["ns_steps"]) == (0.9, False, 4)
        # The scheduler drives the converted optimizer, stepped after each optimizer step.
        assert group["lr"] == pytest.approx(0.03 * 0.5**trainer.global_step)
        assert trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer


def test_torch_optim_muon_is_converted_with_its_settings_and_scheduler() -> None:
    strategy = lc.CanzonaStrategy(data_parallel_size=2, tensor_parallel_size=2, start_method="fork")
    trainer = _trainer(strategy, callbacks=[CheckConversion()], max_steps=3)
    trainer.fit(TorchMuonModel(preset="tiny"), datamodule=ByteTextDataModule(seq_len=32, batch_size=4))


class LogsProgress(CausalLanguageModel):
    def training_step(self, batch, batch_idx):
        self.log("progress", float(self.global_step))  # every step is a new best
        return super().training_step(batch, batch_idx)


def test_callbacks_agree_over_every_rank_under_tensor_parallelism(tmp_path) -> None:
    """ModelCheckpoint's top-k and file-name decisions are agreed over every rank, not only DP."""
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, monitor="progress", mode="max", save_top_k=1, every_n_train_steps=1
    )
    strategy = lc.CanzonaStrategy(data_parallel_size=1, tensor_parallel_size=2, start_method="fork")
    trainer = _trainer(strategy, [checkpoint], devices=2, max_steps=3, enable_checkpointing=True)
    trainer.fit(LogsProgress(preset="tiny"), datamodule=ByteTextDataModule(seq_len=32, batch_size=4))
    assert Path(checkpoint.best_model_path).name == "epoch=0-step=3.ckpt"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["epoch=0-step=3.ckpt"]


class MissingModulePlan(CausalLanguageModel):
    def tensor_parallel_plan(self):
        return {**super().tensor_parallel_plan(), "model.layers.0.mlp.fc9": None}


class ComposesItself(CausalLanguageModel):
    def configure_model(self) -> None:
        lc.composition.compose(self, self.device_mesh)


@pytest.mark.parametrize(
    "module, strategy, fit_kwargs, error, message",
    [
        (
            CausalLanguageModel,
            {"tensor_parallel_size": 4},
            {},
            ValueError,
            r"tensor_parallel_size=4 does not divide Qwen3Config\.num_key_value_heads=2.*\[1, 2\]",
        ),
        (
            MissingModulePlan,
            {"tensor_parallel_size": 2},
            {},
            ValueError,
            r"names modules that do not exist: \['model.layers.0.mlp.fc9'\]",
        ),
        (
            CausalLanguageModel,
            {},
            {"ckpt_path": "missing.ckpt"},
            FileNotFoundError,
            r"ckpt_path='missing.ckpt' does not",
        ),
        (
            ComposesItself,
            {"compile": True},
            {},
            ValueError,
            r"ComposesItself\.configure_model composes its own: pass compile_options to .*compose there",
        ),
    ],
    ids=["tp-vs-kv-heads", "plan-names-a-missing-module", "missing-ckpt_path", "compile-own-composition"],
)
def test_mistakes_fail_in_the_launching_process_before_any_rank_starts(
    module, strategy, fit_kwargs, error, message
) -> None:
    trainer = _trainer(lc.CanzonaStrategy(start_method="fork", **strategy))
    # The error itself, raised here: a rank's error would come back as another exception.
    with pytest.raises(error, match=message):
        trainer.fit(module(preset="tiny"), datamodule=ByteTextDataModule(seq_len=32), **fit_kwargs)
    assert not getattr(trainer.strategy.launcher, "procs", [])  # no rank was started


def test_cli_help_shows_every_strategy_argument(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--trainer.strategy.help", "CanzonaStrategy"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for argument in (
        "data_parallel_size",
        "tensor_parallel_size",
        "plan",
        "save_distributed_checkpoint",
        "process_group_backend",
        "timeout",
    ):
        assert f"--trainer.strategy.{argument}" in shown, argument
    for setting in ("policy", "alpha", "cost", "micro_group_capacity", "max_team", "team_prices", "overlap"):
        assert f"``{setting}``" in shown, setting  # named in the description of `plan`


def _fit_with_cli(tmp_path, *overrides: str, config: Path = TINY_CONFIG) -> str:
    """``canzona fit`` on the main job's config, briefly; returns everything it printed."""
    quick = ["--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false"]
    command = ["canzona", "fit", "--config", str(config), *quick, *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_cli_runs_the_main_job_config_quietly_on_the_mesh_auto_chose(tmp_path) -> None:
    output = _fit_with_cli(tmp_path, "--trainer.max_steps", "3")
    # `strategy: canzona`: "auto" sizes, which the model's 2 key/value heads limit to TP 2.
    (mesh,) = [line for line in output.splitlines() if "device mesh" in line]
    assert "data_parallel 2 × tensor_parallel 2" in mesh and "num_key_value_heads=2" in mesh
    assert "lightning_canzona plan on mesh (2, 2)" in output and "policy canzona" in output
    assert "`max_steps=3` reached" in output
    assert not warning_lines(output), output


@pytest.mark.parametrize("config", ["tiny.yaml", "tiny-moe.yaml"])
def test_the_main_jobs_validate_at_their_last_step(config) -> None:
    # Steps counted across epochs (an epoch is 216 batches): validation at 100, 200 and 300, the end.
    trainer = OmegaConf.load(TINY_CONFIG.parent / config).trainer
    assert trainer.check_val_every_n_epoch is None and trainer.max_steps % trainer.val_check_interval == 0


def test_cli_runs_the_mixture_of_experts_config_with_experts_updated_where_they_lie(examples) -> None:
    code, output, _ = examples["cli-moe"]
    assert code == 0, output[-3000:]
    assert "`max_steps=2` reached" in output and not warning_lines(output)
    # `strategy: canzona`: the heads allow TP 2 (the experts are not split over TP).
    assert "device mesh data_parallel 2 × tensor_parallel 2" in output
    # The expert stacks live on the data-parallel slice of the (2, 2) mesh, replicated over TP;
    # they are planned with attention on the whole mesh, so that each expert is computed once:
    # 4 blocks × (4 attention matrices + 2 stacks × 8 experts), and no plan on the slice.
    assert "lightning_canzona plan on mesh (2,)" not in output
    assert _planned_matrices(output) == 80


def test_cli_top_level_optimizer_is_built_from_the_sharded_model_with_matrix_groups(examples) -> None:
    code, output, _ = examples["cli-top-level-soap"]
    assert code == 0, output[-3000:]
    assert "device mesh data_parallel 2 × tensor_parallel 1" in output and "policy lpt" in output
    assert "`max_steps=2` reached" in output
    # 28 matrices (4 blocks × 7 linear layers); the embedding and the head went to AdamW.
    assert _planned_matrices(output) == 28


def _planned_matrices(output: str) -> int:
    """The matrix count of the plan table printed at fit start (rows: rank, load, matrices, state,
    peak)."""
    table = output.split("lightning_canzona plan on mesh", 1)[1].split("policy ", 1)[0]
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", table, re.M)
    return sum(int(row[2]) for row in rows)


@pytest.mark.parametrize("optimizer_class", [lc.Muon, lc.NorMuon])
def test_cli_top_level_optimizer_takes_matrix_param_groups_and_configs_interpolate(
    tmp_path, optimizer_class
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  max_steps: 7\n  val_check_interval: ${trainer.max_steps}\n"
        f"optimizer:\n  class_path: lightning_canzona.{optimizer_class.__name__}\n"
        "  init_args:\n    lr: 0.05\n"
        "lr_scheduler:\n  class_path: torch.optim.lr_scheduler.StepLR\n  init_args:\n    step_size: 3\n"
    )
    arguments = ["--config", str(TINY_CONFIG), "--config", str(config), "--trainer.devices", "1"]
    cli = CanzonaCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        args=[*arguments, "--trainer.strategy", "auto"],
        run=False,
    )
    assert cli.trainer.val_check_interval == 7
    (optimizer,), (scheduler,) = cli.model.configure_optimizers()
    assert type(optimizer) is optimizer_class and scheduler.optimizer is optimizer
    adamw = [
        name
        for group in optimizer.param_groups
        if group["algorithm"] == "adamw"
        for name in group["param_names"]
    ]
    assert "model.embed_tokens.weight" in adamw and "model.lm_head.weight" in adamw
    assert optimizer.param_groups[0]["lr"] == 0.05


def _cli(*arguments: object) -> CanzonaCLI:
    """``canzona`` on ``arguments``, up to the objects it builds."""
    arguments = [str(argument) for argument in arguments]
    return CanzonaCLI(subclass_mode_model=True, subclass_mode_data=True, args=arguments, run=False)


@pytest.mark.parametrize(
    "config, arguments, settings",
    [
        (
            TINY_CONFIG,
            [
                "--trainer.strategy.data_parallel_size",
                4,
                "--trainer.strategy.data_parallel_replicate_size",
                2,
            ],
            {"_requested_sizes": (4, "auto"), "data_parallel_replicate_size": 2},
        ),
        (  # the registered name, in the nested form
            TINY_CONFIG.with_name("tiny-moe.yaml"),
            [
                "--config",
                "{trainer: {strategy: {class_path: canzona_notebook, init_args: {plan: {max_team: 1}}}}}",
            ],
            {"start_method": "fork", "plan_config.max_team": 1, "plan_config.policy": "canzona"},
        ),
        (  # settings alone in a second file, over `strategy: canzona_notebook`
            TINY_CONFIG,
            [
                "--trainer.strategy",
                "canzona_notebook",
                "--config",
                "{trainer: {strategy: {tensor_parallel_size: 1}}}",
            ],
            {"start_method": "fork", "_requested_sizes": ("auto", 1)},
        ),
    ],
    ids=["command-line", "class_path-name", "settings-file"],
)
def test_every_strategy_setting_comes_from_yaml_and_the_command_line(config, arguments, settings) -> None:
    strategy = _cli("--config", config, *arguments).trainer.strategy
    assert type(strategy) is lc.CanzonaStrategy
    for name, value in settings.items():
        assert functools.reduce(getattr, name.split("."), strategy) == value, name


def test_lightnings_strategy_names_are_left_to_lightning() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    assert type(_cli("--config", TINY_CONFIG, "--trainer.strategy", "ddp").trainer.strategy) is DDPStrategy
    nested = _cli(
        *("--config", TINY_CONFIG, "--trainer.strategy", "ddp_spawn"),
        *("--trainer.strategy.find_unused_parameters", "true"),
    )
    assert nested.trainer.strategy._start_method == "spawn"  # its registered settings, and the given one
    assert nested.trainer.strategy._ddp_kwargs["find_unused_parameters"] is True


def _fails(*arguments: object) -> list[str]:
    """What ``canzona`` printed when it refused ``arguments``, line by line."""
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(io.StringIO()) as printed:
        main([str(argument) for argument in arguments])
    assert exited.value.code == 2
    return printed.getvalue().splitlines()


@pytest.mark.parametrize(
    "arguments, error",
    [
        (
            ["--trainer.strategy.tensor_paralel_size", "1"],
            "trainer.strategy: CanzonaStrategy has no setting 'tensor_paralel_size'; did you mean "
            "'tensor_parallel_size'? (--trainer.strategy.help CanzonaStrategy lists them)",
        ),
        (
            ["--config", "{trainer: {strategy: {init_args: {plan: {polcy: lpt}}}}}"],
            "trainer.strategy: CanzonaStrategy has no setting 'plan.polcy'; did you mean 'plan.policy'? "
            "(--trainer.strategy.help CanzonaStrategy lists them)",
        ),
    ],
    ids=["command-line", "yaml"],
)
def test_a_misspelt_strategy_setting_is_one_error_naming_the_nearest(arguments, error) -> None:
    *tip, line = _fails("fit", "--config", TINY_CONFIG, *arguments)
    assert line == f"error: {error}"
    assert tip in ([], ["tip: For details of accepted options run: canzona fit --help"])  # newer jsonargparse


def test_the_command_lists_every_subcommand_with_what_it_does(capsys) -> None:
    from lightning_canzona.cli import COMMANDS

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    listed = capsys.readouterr().out
    for command in [*CanzonaCLI.subcommands(), *COMMANDS]:
        assert re.search(rf"^    {command} +[A-Z]", listed, re.M), command
    choices = ", ".join(f"'{command}'" for command in [*CanzonaCLI.subcommands(), *COMMANDS])
    assert f"invalid choice: 'fitt' (choose from {choices})" in _fails("fitt")[-1]
    with pytest.raises(SystemExit) as exited:
        main(["export", "--help"])
    assert exited.value.code == 0 and "usage: canzona export" in capsys.readouterr().out


def test_a_bad_optimizer_keyword_names_the_class_when_the_model_is_built() -> None:
    with pytest.raises(
        TypeError, match=r"^Muon\(\) got an unexpected keyword argument 'lrr'. Did you mean 'lr'\?"
    ):
        CausalLanguageModel("tiny", optimizer=functools.partial(lc.Muon, lrr=0.02))
    with pytest.raises(TypeError, match=r"^SOAP\(\) got an unexpected keyword argument 'precondition_freq'"):
        lc.SOAP([torch.nn.Parameter(torch.zeros(2, 2))], precondition_freq=5)


def _run_headline(
    tmp_path,
    strategy: str = '"canzona"',
    devices: int = 4,
    model: str = "CausalLanguageModel",
    fit: str = "",
) -> tuple[int, str]:
    """The README's headline, ``Trainer(strategy="canzona", devices=4)``, in a user's script (which
    Lightning re-runs once per rank); returns its exit code and everything it printed."""
    script = tmp_path / "train.py"
    script.write_text(headline(strategy, devices, model, fit))
    return run_script(script, cwd=tmp_path)


def test_the_headline_trains_the_bundled_model_on_a_mesh_it_can_take(examples) -> None:
    # Its ranks forked from the script's process: the launch that re-runs the script once per
    # rank is the main job's test (`canzona fit`) and the failure tests' below.
    code, output, _ = examples["headline"]
    assert code == 0, output[-3000:]
    assert "device mesh data_parallel 2 × tensor_parallel 2" in output
    assert "`max_steps=2` reached" in output and not warning_lines(output)


def test_a_mistake_in_the_headline_is_one_error_before_any_rank_starts(examples) -> None:
    # A misspelt keyword in configure_optimizers, in a user's script; the mesh and checkpoint
    # mistakes are raised the same way (test_mistakes_fail_in_the_launching_process_...).
    code, output, _ = examples["headline-misspelt"]
    message = "TypeError: Muon() got an unexpected keyword argument 'wieght_decay'. Did you mean"
    assert code == 1
    assert output.count(message) == 1 and output.count("Traceback") == 1, output
    assert "Initializing distributed" not in output  # no rank started


def test_a_failure_on_every_rank_prints_one_traceback_and_a_line_per_other_rank(tmp_path) -> None:
    # The reports of an earlier launch whose launching process has ended, and of a live one.
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    reports = Path(tempfile.gettempdir())
    stale, live = (reports / f"lightning_canzona-{pid}" for pid in (ended.pid, os.getpid()))
    for folder in (stale, live):
        folder.mkdir(exist_ok=True)
        (folder / "rank1.txt").write_text("Traceback (most recent call last): …")
    try:
        code, output = _run_headline(tmp_path, devices=2, model="Fails")
        assert (live / "rank1.txt").exists() and not stale.exists()  # the launch removed it
    finally:
        shutil.rmtree(live)
    assert code != 0
    assert output.count("Traceback (most recent call last)") == 1, output
    (line,) = [line for line in output.splitlines() if line.startswith("[rank1]: RuntimeError")]
    assert "the loss went wrong on every rank" in line
    # The file the line names is there to read after the run, in the folder of the process that
    # launched the ranks (the script): the first launch after it ended removes it.
    path = Path(line.split("its traceback is in ")[1].rstrip(")"))
    assert "Traceback (most recent call last)" in path.read_text() and "training_step" in path.read_text()
    assert path.parent.parent == reports and path.parent.name.startswith("lightning_canzona-")
    shutil.rmtree(path.parent)


class WrappedWithFSDP1(CausalLanguageModel):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.model.layers[0] = FullyShardedDataParallel(self.model.layers[0], device_id=torch.device("cpu"))


def test_fsdp1_wrapped_modules_are_a_clear_error() -> None:
    strategy = lc.CanzonaStrategy(data_parallel_size=2, tensor_parallel_size=1, start_method="fork")
    with pytest.raises(Exception, match=r"FullyShardedDataParallel \(FSDP1\)"):
        _trainer(strategy, devices=2).fit(
            WrappedWithFSDP1(preset="tiny"), datamodule=ByteTextDataModule(seq_len=32)
        )


def test_an_optimizer_setting_out_of_range_in_a_config_is_refused_before_any_rank_starts(tmp_path) -> None:
    # A keyword the optimizer does not take is jsonargparse's to refuse (troubleshooting's "A
    # mistyped setting in a config file"); a value is the optimizer's, in the launching process.
    config = tmp_path / "config.yaml"
    config.write_text("optimizer:\n  class_path: lightning_canzona.Muon\n  init_args:\n    momentum: 1.5\n")
    arguments = ["--config", str(TINY_CONFIG), "--config", str(config), "--trainer.devices", "2"]
    cli = CanzonaCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=[*arguments, "--trainer.strategy", "canzona_notebook"],  # forked ranks, were any started
        run=False,
    )
    with pytest.raises(
        ValueError, match=r"^param_groups\[0\] \(muon\): momentum must lie in \[0, 1\), got 1.5"
    ):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert not multiprocessing.active_children()  # no rank was started
