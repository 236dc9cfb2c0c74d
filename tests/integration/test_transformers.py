"""Hugging Face ``transformers`` models under CanzonaStrategy, with no plan or configure_model of ours.

Tiny configs built here, random init, nothing downloaded. Each model trains 3 steps under the
strategy and again in this process with the one-process optimizer on the full batches; every
parameter's accumulated update must agree (float32 compute; bounds in the test). Under tensor
parallelism each data-parallel rank reads its own share of every batch, as a distributed sampler
gives it; under data parallelism alone every rank reads the whole batch, so that the run is
bit-exact. Qwen3 and GPT-2 tie the output head to the embedding: the tie must hold, one parameter
updated once, equal on every replica.
"""

from __future__ import annotations

import ast
import logging
import math
import os
from pathlib import Path

import pytest
import torch
import transformers
from lightning import Callback, LightningModule
from lightning.fabric import Fabric
from printed import warning_lines
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

import lightning_canzona as lc
from lightning_canzona import composition, huggingface
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
    "qwen3": lambda: transformers.Qwen3Config(**DECODER, tie_word_embeddings=True),
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


def _is_tied(model: transformers.PreTrainedModel) -> bool:
    """Whether the output head's weight is the embedding's, one parameter."""
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _replicas_agree(weights: dict[str, torch.Tensor]) -> bool:
    """Whether every rank holds the same whole weights (the data-parallel replicas stayed equal)."""
    flat = torch.cat([weight.flatten() for weight in weights.values()])
    gathered = [torch.empty_like(flat) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, flat)
    return all(torch.equal(replica, flat) for replica in gathered)


class SaveFullWeights(Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in pl_module.named_parameters()}
        agree = _replicas_agree(full)
        if trainer.global_rank == 0:
            weights = {n: p.detach().clone() for n, p in full.items()}
            torch.save({"weights": weights, "tied": _is_tied(pl_module.model), "agree": agree}, self.path)


def _train_under_strategy(
    quiet_trainer, tmp_path, module: CausalLM, dp, tp, shares: int
) -> dict[str, object]:
    trainer = quiet_trainer(
        strategy=lc.CanzonaStrategy(data_parallel_size=dp, tensor_parallel_size=tp, start_method="fork"),
        max_steps=STEPS,
        use_distributed_sampler=shares > 1,  # else the same batches on every rank
        callbacks=[SaveFullWeights(tmp_path / "weights.pt")],
    )
    # Lightning's distributed sampler shuffles the rows (`_shuffled_by_the_sampler`) and gives
    # data-parallel rank r the rows r, r + shares, … of that order: in each step, together, the
    # one-process run's batch.
    trainer.fit(module, DataLoader(_batches(), batch_size=BATCH // shares))
    return torch.load(tmp_path / "weights.pt")


def _shuffled_by_the_sampler(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` in the order of the first epoch of the sampler that Lightning's Trainer gives a
    training dataloader (shuffled with the global seed), before it splits them across ranks."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    return rows[list(DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=seed))]


def _train_in_one_process(module: CausalLM, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``module`` trained on ``rows`` (default: `_batches`) in batches of ``BATCH``."""
    optimizer = module.configure_optimizers()
    for batch in DataLoader(_batches() if rows is None else rows, batch_size=BATCH):
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
    shares = mesh.data_parallel_size if mesh.tensor_parallel_size > 1 else 1
    with caplog.at_level(logging.INFO):
        trained = _train_under_strategy(quiet_trainer, tmp_path, module, dp, tp, shares)
    assert mesh.describe() in caplog.messages
    reference_module = CausalLM(name)
    reference_module.load_state_dict(initial, strict=False)  # tied weights appear once
    rows = _shuffled_by_the_sampler(_batches()) if shares > 1 else _batches()
    reference = _train_in_one_process(reference_module, rows)

    assert trained["tied"] == _is_tied(reference_module.model) == (name in ("qwen3", "gpt2"))
    assert trained["agree"]
    _assert_trained_alike(trained["weights"], reference, initial, mesh.tensor_parallel_size > 1)


def _assert_trained_alike(distributed: dict, reference: dict, initial: dict, tensor_parallel: bool) -> None:
    """Every parameter's update equals the one-process run's within what the mesh explains.

    Data parallelism alone, every rank on the whole batch, changes no reduction order (equal
    gradients averaged): measured bit for bit equal here. (On shares of the batch it would: GPT-2's
    key bias, whose gradient is zero but for rounding, then steps by AdamW's normalised noise.)
    Tensor parallelism, with or without shares, sums in another order, float32 noise
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


def _train_with_fabric(fabric: Fabric, name: str) -> dict[str, object]:
    """A Fabric loop over the transformers model itself (no LightningModule): its own TP plan."""
    torch.manual_seed(0)
    model = fabric.setup_module(transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()))
    tied_after_setup = _is_tied(model.module)
    optimizer = fabric.setup_optimizers(lc.Muon(lc.matrix_param_groups(model), **MUON))
    # Fabric's distributed sampler gives data-parallel rank r the rows r, r + size, … in order.
    data_parallel_size = fabric.strategy.device_mesh["data_parallel"].size()
    for batch in fabric.setup_dataloaders(DataLoader(_batches(), batch_size=BATCH // data_parallel_size)):
        optimizer.zero_grad()
        fabric.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
    whole = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.module.named_parameters()}
    return {  # rank 0's is the launch's result
        "weights": {name: weight.detach() for name, weight in whole.items()},
        "tied": tied_after_setup and _is_tied(model.module),
        "agree": _replicas_agree(whole),
    }


def test_a_transformers_model_trains_exactly_in_a_fabric_loop(one_thread) -> None:
    # The model is the root: its tied embedding and head sit in different FSDP2 units (the
    # decoder, the head), so the tied weight is tensor-parallel but not sharded by FSDP2.
    fabric = Fabric(accelerator="cpu", devices=4, strategy="canzona_notebook")
    trained = fabric.launch(_train_with_fabric, "qwen3")
    torch.manual_seed(0)
    module = CausalLM("qwen3")  # the same initial weights, under the wrapper's "model." prefix
    initial = {n.removeprefix("model."): p.detach().clone() for n, p in module.named_parameters()}
    reference = {n.removeprefix("model."): p for n, p in _train_in_one_process(module).items()}
    assert trained["tied"] and trained["agree"]
    _assert_trained_alike(trained["weights"], reference, initial, tensor_parallel=True)  # auto: dp 2 × tp 2


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


@pytest.mark.parametrize("example", ["transformers-moe", "own-model"])
def test_the_documented_examples_train(examples, example) -> None:
    code, output, _ = examples[example]
    assert code == 0, output[-3000:]
    (line,) = [line for line in output.splitlines() if line.startswith("final train_loss")]
    assert float(line.split()[-1]) < math.log(256) - 1.0  # well below a uniform guess over bytes
    assert not warning_lines(output), output[-3000:]
