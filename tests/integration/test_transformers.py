"""Hugging Face ``transformers`` models under CanzonaStrategy, with no plan or configure_model of ours.

Tiny configs built here, random init, nothing downloaded. Each model trains 3 steps under the
strategy (every rank sees the same batches, so data parallelism averages equal gradients) and
again in this process with the one-process optimizer on the full model; every parameter's
accumulated update must agree (float32 compute; bounds in the test).
"""

from __future__ import annotations

import ast
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from lightning import Callback, LightningModule
from lightning.fabric import Fabric
from printed import warning_lines
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_canzona as lc
from lightning_canzona import composition, huggingface
from lightning_canzona.checkpoint.state import full_model_state
from lightning_canzona.mesh import choose_mesh

STEPS, BATCH, SEQ, VOCAB = 3, 8, 32, 128
MUON = {"lr": 0.02, "adamw_lr": 3e-3, "compute_dtype": "float32"}
# The decoder shapes the Qwen3, Llama and Qwen3-MoE configs share.
DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**DECODER),
    "llama": lambda: transformers.LlamaConfig(**DECODER),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **DECODER, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
}


#: Qwen3-MoE's expert entries of its TP plan as transformers 5.24 declares them; 5.25 leaves the
#: experts out of tensor parallelism (replicated over it). Declared here, so that the experts'
#: tensor-parallel path (`huggingface.ExpertsParallel`) is tested with either.
EXPERTS_TP_PLAN = {
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts",
}


class CausalLM(LightningModule):
    """A transformers causal LM as a user would write it: no plan, no configure_model."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
        if name == "qwen3_moe":
            self.model._tp_plan = {**self.model._tp_plan, **EXPERTS_TP_PLAN}

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return lc.Muon(lc.matrix_param_groups(self), **MUON)


def _batches() -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))


class SaveFullWeights(Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in pl_module.named_parameters()}
        if trainer.global_rank == 0:
            torch.save({n: p.detach().clone() for n, p in full.items()}, self.path)


def _train_under_strategy(quiet_trainer, tmp_path, module: CausalLM, dp, tp) -> dict[str, torch.Tensor]:
    trainer = quiet_trainer(
        strategy=lc.CanzonaStrategy(data_parallel_size=dp, tensor_parallel_size=tp, start_method="fork"),
        max_steps=STEPS,
        use_distributed_sampler=False,  # the same batches on every rank
        callbacks=[SaveFullWeights(tmp_path / "weights.pt")],
    )
    trainer.fit(module, DataLoader(_batches(), batch_size=BATCH))
    return torch.load(tmp_path / "weights.pt")


def _train_in_one_process(module: CausalLM) -> dict[str, torch.Tensor]:
    optimizer = module.configure_optimizers()
    for batch in DataLoader(_batches(), batch_size=BATCH):
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()
    return {name: param.detach() for name, param in module.named_parameters()}


@pytest.mark.parametrize(
    ("name", "dp", "tp"),
    [("qwen3", "auto", "auto"), ("llama", "auto", "auto"), ("qwen3_moe", 2, 2), ("gpt2", "auto", "auto")],
    ids=["qwen3-auto", "llama-auto", "qwen3_moe-dp2xtp2", "gpt2-auto"],
)
def test_a_transformers_model_trains_exactly_with_its_own_plan(
    tmp_path, caplog, name, dp, tp, quiet_trainer, one_thread
) -> None:
    torch.manual_seed(0)
    module = CausalLM(name)
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    groups = lc.matrix_param_groups(module)
    matrices = {n for group in groups if "algorithm" not in group for n, _ in group["params"]}
    if name == "gpt2":  # Conv1D weights are matrices (stored transposed), not AdamW's
        assert "model.transformer.h.0.attn.c_attn.weight" in matrices
    if name == "qwen3_moe":  # the expert stacks take the matrix rule; the router AdamW
        assert {
            "model.model.layers.0.mlp.experts.gate_up_proj",
            "model.model.layers.0.mlp.experts.down_proj",
        } <= matrices
        assert "model.model.layers.0.mlp.gate.weight" not in matrices

    # "auto": 2 key/value heads allow tensor parallelism of 2 on 4 devices; GPT-2 declares no
    # plan: FSDP2 over all 4. The launching process says which.
    mesh = choose_mesh(module, dp, tp, 1, 4)
    assert (mesh.data_parallel_size, mesh.tensor_parallel_size) == ((4, 1) if name == "gpt2" else (2, 2))
    with caplog.at_level(logging.INFO):
        distributed = _train_under_strategy(quiet_trainer, tmp_path, module, dp, tp)
    assert mesh.describe() in caplog.messages
    reference_module = CausalLM(name)
    reference_module.load_state_dict(initial, strict=False)  # tied weights appear once
    reference = _train_in_one_process(reference_module)

    _assert_trained_alike(distributed, reference, initial, mesh.tensor_parallel_size > 1)


def _assert_trained_alike(distributed: dict, reference: dict, initial: dict, tensor_parallel: bool) -> None:
    """Every parameter's update equals the one-process run's within what the mesh explains.

    Data parallelism alone changes no reduction order (equal gradients averaged): measured bit
    for bit equal here. Tensor parallelism sums partial products in another order, float32 noise
    that Newton-Schulz amplifies: a float32 run of these models differs from a float64 run by up
    to 1.6e-5 relative; measured up to 1.2e-5 against the reference (Llama o_proj). An update is
    the difference of two float32 weights, so it is known to a few ulps of the weights only:
    Qwen3-MoE's layer-1 input norm (weights ≈ 1, an element whose AdamW steps nearly cancel)
    measured 10 ulps off on one element, 3.1e-5 of its small update.
    """
    tolerance = 3e-5 if tensor_parallel else 1e-6
    ulps = 16 * torch.finfo(torch.float32).eps
    assert distributed.keys() == reference.keys()
    for param_name, expected in reference.items():
        update, expected_update = (
            distributed[param_name] - initial[param_name],
            expected - initial[param_name],
        )
        error = float((update - expected_update).norm())
        bound = tolerance * float(expected_update.norm()) + ulps * float(initial[param_name].norm())
        assert error <= bound, (param_name, error, bound)


def _train_with_fabric(fabric: Fabric, name: str) -> dict[str, torch.Tensor]:
    """A Fabric loop over the transformers model itself (no LightningModule): its own TP plan."""
    torch.manual_seed(0)
    model = fabric.setup_module(transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()))
    optimizer = fabric.setup_optimizers(lc.Muon(lc.matrix_param_groups(model), **MUON))
    for batch in DataLoader(_batches(), batch_size=BATCH):
        optimizer.zero_grad()
        fabric.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
    trained = full_model_state(model)  # whole on rank 0, whose result the launch returns
    return {name: trained[name] for name, _ in model.module.named_parameters() if name in trained}


def test_a_transformers_model_trains_exactly_in_a_fabric_loop(one_thread) -> None:
    fabric = Fabric(accelerator="cpu", devices=4, strategy="canzona_notebook")
    distributed = fabric.launch(_train_with_fabric, "qwen3")
    torch.manual_seed(0)
    module = CausalLM("qwen3")  # the same initial weights, under the wrapper's "model." prefix
    initial = {n.removeprefix("model."): p.detach().clone() for n, p in module.named_parameters()}
    reference = {n.removeprefix("model."): p for n, p in _train_in_one_process(module).items()}
    _assert_trained_alike(distributed, reference, initial, tensor_parallel=True)  # auto: dp 2 × tp 2


def test_a_plan_entry_that_cannot_be_honoured_or_a_size_that_does_not_divide_is_named() -> None:
    torch.manual_seed(0)
    moe = CausalLM("qwen3_moe")
    plan = huggingface.tensor_parallel_plan(moe)  # the experts' packed entries are honoured
    experts = plan["model.model.layers.*.mlp.experts"]
    assert isinstance(experts, huggingface.ExpertsParallel)
    assert set(experts.placements) == {"gate_up_proj", "down_proj"}
    declared = dict(moe.model._tp_plan)
    moe.model._tp_plan = {**declared, "model.norm": "sequence_parallel"}
    with pytest.raises(ValueError, match=r"'model\.model\.norm': 'sequence_parallel'"):
        huggingface.tensor_parallel_plan(moe)
    # An expert stack's placement without the style that runs its module on local blocks.
    moe.model._tp_plan = {k: v for k, v in declared.items() if v != "moe_tp_experts"}
    with pytest.raises(
        ValueError, match=r"'model\.model\.layers\.\*\.mlp\.experts\.gate_up_proj': 'parameter'"
    ):
        huggingface.tensor_parallel_plan(moe)
    with pytest.raises(ValueError, match=r"does not divide Qwen3Config\.num_key_value_heads=2.*\[1, 2\]"):
        composition.check_tensor_parallel_size(CausalLM("qwen3"), 4)
    assert huggingface.fsdp_unit_classes(moe) == {"Qwen3MoeDecoderLayer"}


def test_the_package_never_imports_transformers_itself() -> None:
    # (torchmetrics imports it when it is installed, so sys.modules cannot tell.)
    package = Path(lc.__file__).parent
    importers = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] == "transformers" for name in names):
                importers.append(str(path.relative_to(package)))
    assert not importers


@pytest.mark.parametrize(
    ("script", "arguments"),
    [("transformers_causal_lm.py", ["--model", "qwen3-moe"]), ("own_model.py", [])],
    ids=["transformers-moe", "own-model"],
)
def test_the_documented_examples_train(tmp_path, script, arguments) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "models" / script
    # As a user runs it: a script that Lightning re-runs once per rank.
    done = subprocess.run(
        [sys.executable, str(example), *arguments, "--max_steps", "8"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("final train_loss")]
    assert float(line.split()[-1]) < math.log(256) - 1.0  # well below a uniform guess over bytes
    assert not warning_lines(done.stdout + done.stderr), done.stderr[-3000:]
