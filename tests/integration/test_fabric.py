"""``Fabric(strategy="canzona")``: a hand-written loop trains exactly as one process does.

The loop (`fabric_loop.py`) runs on ranks forked from here, as in a notebook; the reference runs
the same loop here on the whole model with `lc.Muon` and ``torch.nn.utils.clip_grad_norm_``. The
examples run as scripts, their ranks forked (the `examples` fixture); the launch that re-runs a
script per rank is the mismatch test's.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from fabric_loop import (
    check_against_one_process,
    parallelize_mlps,
    train,
)
from fabric_resume import single_file
from fabric_resume import train as resume_run
from lightning.fabric import Fabric
from lightning.fabric.plugins import DoublePrecision
from printed import warning_lines
from safetensors.torch import load_file
from scripts import run_script

import lightning_canzona as lc
from lightning_canzona.cli import main
from lightning_canzona.export import consolidated_weights
from lightning_canzona.launcher import FabricInProcessLauncher
from lightning_canzona.models.qwen3 import PRESETS, Qwen3
from lightning_canzona.precision import check_precision
from lightning_canzona.telemetry import COMPUTE_MAX_MS, COMPUTE_MS, MATRICES, SENT_MIB, STEP_MS


def test_a_third_party_model_trains_exactly_with_the_users_parallelize_fn(capfd) -> None:
    # A transformers Llama whose own plan the user's parallelize_fn replaces: at dp 2 × tp 2 it
    # splits the MLPs and keeps attention whole on each TP rank. The ranks are forked from here
    # (the script launch is the bundled model's test).
    strategy = lc.CanzonaFabricStrategy(2, 2, parallelize_fn=parallelize_mlps, start_method="fork")
    trained = Fabric(accelerator="cpu", devices=4, strategy=strategy).launch(train, "joint", "llama")
    # One plan over the whole mesh: attention's matrices, whole on each TP rank, are computed
    # once too (one owner for the TP replicas of its data-parallel shards), like the split MLPs.
    assert trained["meshes"] == [(2, 2)]
    printed = "".join(capfd.readouterr())
    assert not warning_lines(printed), printed[-3000:]
    check_against_one_process(trained, tensor_parallel=True, model_name="llama")


def test_fabric_takes_the_strategy_by_name_and_checks_its_settings_before_any_rank_starts() -> None:
    assert isinstance(
        Fabric(accelerator="cpu", devices=4, strategy="canzona").strategy, lc.CanzonaFabricStrategy
    )
    with pytest.raises(ValueError, match=r"data_parallel_size=3 does not divide the 4 devices"):
        Fabric(accelerator="cpu", devices=4, strategy=lc.CanzonaFabricStrategy(data_parallel_size=3))
    with pytest.raises(ValueError, match=r"precision='16-true' is not supported by CanzonaFabricStrategy"):
        Fabric(accelerator="cpu", devices=4, strategy="canzona", precision="16-true")
    # Lightning refuses 64-true for its model-parallel strategies first; ours says why, and how.
    with pytest.raises(ValueError, match=r"'64-true' .*: .* no float64 precision; .*\(model\.double\(\)\)"):
        check_precision(DoublePrecision(), "CanzonaFabricStrategy")
    with pytest.raises(TypeError, match="plan must be a lightning_canzona.PlanConfig"):
        lc.CanzonaFabricStrategy(plan={"policy": "lpt"})


# A model that cannot take the sizes asked for: tensor parallelism over 2 ranks, 1 key/value head.
# Fabric builds the model after the launch: only the ranks can see it.
MISMATCH = "ValueError: tensor_parallel_size=2 does not divide Qwen3Config.num_key_value_heads=1"
MISMATCHED_SCRIPT = """
import dataclasses
from datetime import timedelta
from lightning.fabric import Fabric
import lightning_canzona as lc
from lightning_canzona.models.qwen3 import PRESETS, Qwen3

strategy = lc.CanzonaFabricStrategy(tensor_parallel_size=2, timeout=timedelta(seconds=30))
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()  # under torchrun, which started every rank
model = fabric.setup_module(Qwen3(dataclasses.replace(PRESETS["tiny"], num_key_value_heads=1)))
"""


def test_under_torchrun_a_model_that_cannot_take_the_sizes_is_one_traceback_and_a_line_per_other_rank(
    tmp_path,
) -> None:
    # Every rank checks the model, as under any launcher that starts the ranks itself (the
    # Trainer's script launch: test_strategy's failure test); torchrun adds its own summary.
    script = tmp_path / "train.py"
    script.write_text(MISMATCHED_SCRIPT)
    code, output = run_script(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script, cwd=tmp_path
    )
    assert code != 0 and "device mesh" not in output, output  # refused before the mesh was built
    assert output.count("[rank0]: Traceback (most recent call last)") == 1, output
    assert output.count(MISMATCH) == 2 and output.count("[rank1]: Traceback") == 0, output
    (line,) = [line for line in output.splitlines() if line.startswith(f"[rank1]: {MISMATCH}")]
    path = Path(line.split("its traceback is in ")[1].rstrip(")"))
    assert MISMATCH in path.read_text()
    path.unlink()


def _set_up_one_kv_head(fabric: Fabric) -> None:
    fabric.setup_module(Qwen3(dataclasses.replace(PRESETS["tiny"], num_key_value_heads=1)))


def test_a_notebook_launch_of_a_model_that_cannot_take_the_sizes_is_one_report(capfd) -> None:
    timeout = timedelta(seconds=30)
    strategy = lc.CanzonaFabricStrategy(tensor_parallel_size=2, start_method="fork", timeout=timeout)
    with pytest.raises(Exception, match="terminated with the following error") as raised:
        Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(_set_up_one_kv_head)
    printed = "".join(capfd.readouterr())
    assert f"{printed}{raised.value}".count(MISMATCH) == 1  # torch reports the first rank that failed
    assert "device mesh" not in printed


def _resume_run(dp: int, tp: int, checkpoint: Path, phase: str) -> dict[str, Any]:
    strategy = lc.CanzonaFabricStrategy(dp, tp, start_method="fork")
    return Fabric(accelerator="cpu", devices=4, strategy=strategy).launch(resume_run, str(checkpoint), phase)


def test_a_fabric_checkpoint_resumes_at_tp4_with_every_owners_state(tmp_path, capfd) -> None:
    # Saved at dp 2 × tp 2 in both formats, resumed at dp 1 × tp 4 (the Trainer's tests reshard
    # to dp 4), where other ranks own the matrices, each expert's among them.
    checkpoint = tmp_path / "checkpoint"
    uninterrupted = _resume_run(2, 2, checkpoint, "first")["weights"]
    assert (checkpoint / "manifest.json").is_file()  # verified when loaded
    resumed = _resume_run(1, 4, checkpoint, "resumed")
    printed = "".join(capfd.readouterr())
    assert not warning_lines(printed), printed[-3000:]
    # Either format restores the weights and every owner's state as the single file holds them,
    # exactly: the experts' factors, eigenbases and step counts each under its expert's keys.
    saved = torch.load(single_file(str(checkpoint)), weights_only=True)
    assert "stack3_left_basis" in saved["optimizer"]["state"]["layers.1.mlp.experts.down_proj"]
    for restored in resumed["loaded"].values():
        torch.testing.assert_close(restored["model"], saved["model"], rtol=0, atol=0)
        torch.testing.assert_close(
            restored["optimizer"]["state"], saved["optimizer"]["state"], rtol=0, atol=0
        )
    # The same training up to the order in which TP ranks sum partial products, which SOAP's
    # eigenbases grow. Measured, of the largest weight: 3.3e-5 (2.8e-4 without the experts);
    # resumed without the optimizer's state, 0.66.
    for name, weight in uninterrupted.items():
        bound = 1e-3 * float(weight.abs().max())
        assert torch.allclose(resumed["weights"][name], weight, rtol=0, atol=bound), name


def test_the_fabric_example_pretrains_logs_the_step_costs_and_saves(examples) -> None:
    # Saved to runs/pretrain/checkpoint, as the example's docstring shows.
    code, printed, tmp_path = examples["fabric-pretrain"]
    assert code == 0, printed[-3000:]
    assert "lightning_canzona: device mesh data_parallel 2 × tensor_parallel 2" in printed
    assert "trained 2 steps" in printed and not warning_lines(printed), printed[-3000:]
    run = tmp_path / "runs" / "pretrain"
    assert [path.name for path in tmp_path.iterdir()] == ["runs"]  # nothing else in the folder
    assert (run / "checkpoint" / "manifest.json").is_file()  # loadable with --resume
    with open(run / "logs" / "metrics.csv") as file:
        logged = [row for row in csv.DictReader(file) if row.get(STEP_MS)]
    assert [int(row["step"]) for row in logged] == [1, 2]
    for row in logged:  # every rank's costs, gathered (the Trainer's telemetry test checks them all)
        assert float(row[STEP_MS]) >= float(row[COMPUTE_MAX_MS]) >= float(row[COMPUTE_MS]) > 0
        assert float(row[MATRICES]) > 0 and float(row[SENT_MIB]) > 0


def test_the_fabric_example_fine_tunes_a_transformers_model_and_exports_it(examples) -> None:
    code, printed, tmp_path = examples["fabric-finetune"]
    assert code == 0, printed[-3000:]
    assert "lightning_canzona: device mesh data_parallel 2 × tensor_parallel 2" in printed
    assert not warning_lines(printed), printed[-3000:]
    before, after = map(
        float, re.search(r"held-out loss: ([\d.]+) before, ([\d.]+) after 4 steps", printed).groups()
    )
    assert after < before - 0.5  # measured: 5.390 → 4.511
    run = tmp_path / "runs" / "finetune"
    assert [path.name for path in tmp_path.iterdir()] == ["runs"]  # nothing else in the folder
    assert sorted(path.name for path in run.iterdir()) == ["base", "checkpoint", "tuned"]
    tuned_model = transformers.AutoModelForCausalLM.from_pretrained(run / "tuned")
    tuned = tuned_model.state_dict()
    saved = consolidated_weights(run / "checkpoint", model_key="model")
    # The head stays tied to the embedding: one weight, equal on the data-parallel replicas that
    # wrote its two names to the checkpoint, and tied again by from_pretrained.
    assert torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert tuned_model.lm_head.weight is tuned_model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="holds no model under 'state_dict': its model is under 'model'"):
        consolidated_weights(run / "checkpoint", "state_dict")  # the Trainer's key: said, not an empty export
    main(["export", str(run / "checkpoint"), str(tmp_path / "tuned.safetensors")])  # the one model
    assert load_file(tmp_path / "tuned.safetensors").keys() == tuned.keys() == saved.keys()
    for name, weight in saved.items():
        assert torch.equal(tuned[name], weight), name


def test_a_notebook_launch_forks_safely_after_threaded_work_and_trains_exactly(capfd) -> None:
    # What a notebook cell does before the launch: OpenMP runs on several threads in this process.
    torch.cos(torch.randn(1 << 22))
    fabric = Fabric(accelerator="cpu", devices=4, strategy="canzona_notebook")
    assert isinstance(fabric.strategy.launcher, FabricInProcessLauncher)
    # setup_module then setup_optimizers (fabric.setup(model, optimizer) is the Llama's test).
    trained = fabric.launch(train, "separate")
    printed = "".join(capfd.readouterr())
    assert not warning_lines(printed), printed[-3000:]
    assert trained["meshes"] == [(2, 2)]  # auto sizes: the tiny model's 2 key/value heads allow TP 2
    check_against_one_process(trained, tensor_parallel=True)
