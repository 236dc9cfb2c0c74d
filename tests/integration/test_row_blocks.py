"""Declared row blocks: a fused weight updates exactly as its blocks would as separate matrices."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from printed import warning_lines
from torch import nn

import lightning_canzona as lc
from lightning_canzona.rules import muon
from lightning_canzona.rules.blocks import RowBlockRule
from lightning_canzona.rules.shampoo import ShampooRule

# SOAP's first step rotates the gradient into its own singular bases: preconditioned on both
# sides, the rotated gradient is diagonal, and Adam's ratio of its off-diagonal rounding noise to
# that noise's square root is ±1, whatever the rounding. A batched and a single matmul round
# differently, so no two ways of computing it agree. Preconditioning one side (max_precond_dim
# below the longer side) leaves a rotated gradient without structural zeros: a fair comparison.
OPTIMIZERS = {
    "muon": (lc.Muon, {"lr": 0.02, "compute_dtype": "float32"}),
    "shampoo": (lc.Shampoo, {"lr": 1e-2, "precondition_frequency": 2, "start_preconditioning_step": 2}),
    "soap": (lc.SOAP, {"lr": 1e-2, "precondition_frequency": 2, "max_precond_dim": 5}),
}
#: ``(leading dims, block rows, cols, row_blocks)``: a GQA-like fused QKV (Q taller than K and V,
#: every block taller than wide, so Muon's learning-rate scale differs from block to block),
#: one matrix per head, and a stack of fused expert gate/up matrices.
SPLITS = {
    "qkv": ((), (12, 6, 6), 5, (12, 6, 6)),
    "per-head": ((), (6, 6, 6), 5, 3),
    "gate-up-stack": ((3,), (6, 6), 5, 2),
}
STEPS = 4


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_a_split_matrix_updates_like_its_blocks_as_separate_matrices(optimizer_name, split) -> None:
    optimizer_class, kwargs = OPTIMIZERS[optimizer_name]
    leading, sizes, cols, row_blocks = SPLITS[split]
    initial = torch.randn(*leading, sum(sizes), cols) / 3
    fused = nn.Parameter(initial.clone())
    blocks = [nn.Parameter(block.clone()) for block in initial.split(sizes, dim=-2)]
    split_optimizer = optimizer_class([{"params": [("fused", fused)], "row_blocks": row_blocks}], **kwargs)
    separate_optimizer = optimizer_class([(f"block{i}", block) for i, block in enumerate(blocks)], **kwargs)
    whole = nn.Parameter(initial.clone())
    whole_optimizer = optimizer_class([("whole", whole)], **kwargs)
    for _ in range(STEPS):
        grad = torch.randn_like(initial)
        fused.grad, whole.grad = grad.clone(), grad.clone()
        for block, block_grad in zip(blocks, grad.split(sizes, dim=-2)):
            block.grad = block_grad.clone()
        split_optimizer.step()
        separate_optimizer.step()
        whole_optimizer.step()
    separate = torch.cat([block.detach() for block in blocks], dim=-2)
    # float32 rounding only: batched matmuls of the stacked blocks against single ones. Measured:
    # at most 1.2e-7 apart, on weights of ~0.3 moved by ~0.08.
    torch.testing.assert_close(fused.detach(), separate, rtol=1e-6, atol=1e-6)
    # ...and the split is not a no-op: the whole fused matrix moves differently.
    assert (whole.detach() - separate).abs().max() > 1e-3


@pytest.mark.parametrize(
    "row_blocks, calls",
    [(4, [(4, 3, 7)]), ((6, 3, 3), [(1, 6, 7), (2, 3, 7)])],
    ids=["per-head", "qkv"],
)
def test_newton_schulz_runs_once_per_distinct_block_size(monkeypatch, row_blocks, calls) -> None:
    shapes = []

    def counting(matrix, *args, **kwargs):
        shapes.append(tuple(matrix.shape))
        return newton_schulz(matrix, *args, **kwargs)

    newton_schulz = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", counting)
    param = nn.Parameter(torch.randn(12, 7))
    optimizer = lc.Muon([{"params": [param], "row_blocks": row_blocks}], compute_dtype="float32")
    param.grad = torch.randn_like(param)
    optimizer.step()
    assert shapes == calls


def test_the_planner_sees_the_cost_and_state_of_the_blocks() -> None:
    inner = ShampooRule()
    rule = RowBlockRule(inner, (12, 6, 6))
    cost = rule.cost((24, 5))
    assert (
        cost.flops == inner.cost((1, 12, 5)).flops + inner.cost((2, 6, 5)).flops < inner.cost((24, 5)).flops
    )
    assert cost.numel == 24 * 5
    # Decompositions of a 12² and two 6² left factors and three 5² right ones, every 10th step.
    assert (cost.period, cost.periodic_flops) == (10, (10 * (12**3 + 2 * 6**3 + 3 * 5**3),))
    state = rule.init_matrix_state(torch.Size((24, 5)), torch.device("cpu"))
    assert cost.matrix_state_bytes == sum(
        t.nbytes for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


@pytest.mark.parametrize("optimizer_name", ["shampoo", "soap"])
def test_the_blocks_state_round_trips_through_a_state_dict(optimizer_name) -> None:
    optimizer_class, kwargs = OPTIMIZERS[optimizer_name]

    def build(param):
        return optimizer_class([{"params": [("qkv", param)], "row_blocks": (12, 6, 6)}], **kwargs)

    grads = [torch.randn(24, 5) for _ in range(6)]
    param = nn.Parameter(torch.randn(24, 5))
    optimizer = build(param)
    for grad in grads[:3]:
        param.grad = grad
        optimizer.step()
    saved_param, saved = param.detach().clone(), copy.deepcopy(optimizer.state_dict())
    # One flat dict of tensors per parameter (what checkpoints and owner hand-overs move), with
    # no "." in a key: torch's flattened optimizer state dicts split keys on dots.
    assert {"rows12_right", "rows6_right", "rows6_step"} <= saved["state"][0].keys()
    assert all(isinstance(value, torch.Tensor) and "." not in key for key, value in saved["state"][0].items())
    for grad in grads[3:]:
        param.grad = grad
        optimizer.step()
    restored = nn.Parameter(saved_param)
    restored_optimizer = build(restored)
    restored_optimizer.load_state_dict(saved)
    for grad in grads[3:]:
        restored.grad = grad
        restored_optimizer.step()
    assert torch.equal(restored, param)


@pytest.mark.parametrize(
    "row_blocks, message",
    [
        (
            (12, 6, 5),
            r"has row_blocks \(12, 6, 5\): the row sizes \(12, 6, 5\) sum to 23, not to its 24 rows",
        ),
        (5, r"has row_blocks 5: 5 equal row blocks do not divide its 24 rows"),
        ((12, 0, 12), r"has row_blocks \(12, 0, 12\): row_blocks must be a number of equal blocks >= 1"),
        (-2, r"has row_blocks -2: row_blocks must be a number of equal blocks >= 1"),
    ],
)
def test_blocks_that_do_not_fit_are_named_with_the_parameter_and_its_shape(row_blocks, message) -> None:
    weight = nn.Parameter(torch.zeros(24, 5))
    with pytest.raises(ValueError, match=r"Parameter 'attn.qkv.weight' of shape \(24, 5\) " + message):
        lc.Muon([{"params": [("attn.qkv.weight", weight)], "row_blocks": row_blocks}])


def test_row_blocks_on_a_vector_or_an_adamw_group_are_named() -> None:
    weight, bias = nn.Parameter(torch.zeros(24, 5)), nn.Parameter(torch.zeros(24))
    with pytest.raises(ValueError, match=r"Parameter 'qkv.bias' of shape \(24,\) has row_blocks 2, but row"):
        lc.Shampoo([{"params": [("qkv.weight", weight), ("qkv.bias", bias)], "row_blocks": 2}])
    with pytest.raises(
        ValueError, match=r"'qkv.weight' of shape \(24, 5\) has row_blocks 2, .* an AdamW group"
    ):
        lc.SOAP([{"params": [("qkv.weight", weight)], "row_blocks": 2, "algorithm": "adamw"}])


class FusedExperts(nn.Module):
    """A fused gate/up stack with its down stack, stored as transformers 5 does, or transposed
    (Llama 4, GPT-OSS): ``[E, hidden, 2·inner]`` and ``[E, inner, hidden]``."""

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        gate_up, down = ((4, 5, 6), (4, 3, 5)) if transposed else ((4, 6, 5), (4, 5, 3))
        self.gate_up_proj = nn.Parameter(torch.zeros(gate_up))
        self.down_proj = nn.Parameter(torch.zeros(down))


class Block(nn.Module):
    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(5, 24)
        self.out = nn.Linear(24, 5, bias=False)
        self.experts = FusedExperts(transposed)


def _groups(groups: list[dict]) -> list[tuple[list[str], object]]:
    return [([name for name, _ in group["params"]], group.get("row_blocks")) for group in groups]


def test_matrix_param_groups_split_declared_matrices_and_fused_gate_up_by_default() -> None:
    groups = lc.matrix_param_groups(Block(), row_blocks={"qkv.weight": [12, 6, 6]})
    assert _groups(groups) == [
        (["out.weight", "experts.down_proj"], None),
        (["qkv.weight"], (12, 6, 6)),
        (["experts.gate_up_proj"], 2),
        (["qkv.bias"], None),
    ]
    assert groups[-1]["algorithm"] == "adamw"
    whole = lc.matrix_param_groups(Block(), row_blocks={"*.gate_up_proj": 1})
    assert _groups(whole)[0] == (
        ["qkv.weight", "out.weight", "experts.gate_up_proj", "experts.down_proj"],
        None,
    )
    transposed = lc.matrix_param_groups(Block(transposed=True))
    assert "experts.gate_up_proj" in _groups(transposed)[0][0]  # no row halves: left whole
    optimizer = lc.Muon(groups)
    assert optimizer.row_blocks() == {"qkv.weight": (12, 6, 6), "experts.gate_up_proj": 2}


@pytest.mark.parametrize(
    "row_blocks, message",
    [
        ({"*.q_proj.weight": 4}, r"row_blocks pattern '\*.q_proj.weight' matches no trainable parameter"),
        ({"qkv.*": 2}, r"row_blocks pattern 'qkv.\*' matches 'qkv.bias' of shape \(24,\), which is not"),
        ({"qkv.weight": 2, "*.weight": 3}, r"row_blocks patterns give 'qkv.weight' both 2 and 3"),
    ],
)
def test_matrix_param_groups_name_a_row_blocks_pattern_that_does_not_apply(row_blocks, message) -> None:
    with pytest.raises(ValueError, match=message):
        lc.matrix_param_groups(Block(), row_blocks=row_blocks)


def test_the_documented_example_trains_with_split_weights(examples) -> None:
    code, output, _ = examples["fused-weights"]
    assert code == 0, output[-3000:]
    # The strategy says what it splits, and how.
    assert "(8, 8, 8, 8, 8, 8, 8, 8, 16): blocks.0.qkv.weight and 1 more" in output
    assert "2: blocks.0.gate_up.weight and 1 more" in output
    (line,) = [line for line in output.splitlines() if line.startswith("final train_loss")]
    assert float(line.split()[-1]) < math.log(256) - 0.5  # well below a uniform guess over bytes
    assert not warning_lines(output), output[-3000:]
