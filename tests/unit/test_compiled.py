"""``compile=True``: Newton–Schulz compiled with ``torch.compile`` (`lightning_canzona.rules.newton_schulz`),
bit for bit the eager iteration, with no graph break and no graph compiled after the first step.

Inductor costs a CPU about a second per kernel it compiles: Muon's training steps run compiled by
inductor, once for the module (a module-scoped fixture) on the smallest shapes; the Gram form by
blocks (16 kernels, 15–25 s here) is traced by dynamo and run by ``aot_eager``, and compiled by
inductor where compiling is the default, by ``canzona doctor`` on the GPU.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import lightning_canzona as lc
from lightning_canzona.compat import compile_counts, compile_function
from lightning_canzona.rules import newton_schulz as ns
from lightning_canzona.rules.newton_schulz import GRAPHS, PRESETS, compiles

#: A matrix and a bias, as a model holds them.
SHAPES = {"matrix": (6, 10), "bias": (10,)}
STEPS = 3


def _train(compile: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, int]]]:
    """``STEPS`` steps of Muon (AdamW for the bias; Newton–Schulz in bf16, as on a GPU), the
    learning rate changed every step as a scheduler does: the weights after, and
    `compile_counts` before the first step and after each."""
    generator = torch.Generator().manual_seed(0)
    params = {
        name: torch.nn.Parameter(torch.randn(shape, generator=generator)) for name, shape in SHAPES.items()
    }
    optimizer = lc.Muon(list(params.items()), lr=0.02, compute_dtype="bfloat16", compile=compile)
    counts = [compile_counts()]
    for _ in range(STEPS):
        for param in params.values():
            param.grad = torch.randn(param.shape, generator=generator)
        for group in optimizer.param_groups:
            group["lr"] *= 0.9
        optimizer.step()
        counts.append(compile_counts())
    return {name: param.detach() for name, param in params.items()}, counts


@pytest.fixture(scope="module")
def trained() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict[str, int]]]:
    """The eager run's weights, the compiled run's, and the compiled run's counts."""
    return (_train(False)[0], *_train(True))


def test_compiled_steps_equal_eager_ones_bit_for_bit(trained) -> None:
    eager, compiled_weights, _ = trained
    for name in SHAPES:
        assert torch.equal(compiled_weights[name], eager[name]), name


def test_compiled_steps_break_no_graph_and_compile_only_at_the_first(trained) -> None:
    _, _, (before, first, *later) = trained
    assert first["graphs"] - before["graphs"] == 1
    assert first["graph_breaks"] == before["graph_breaks"]
    assert all(counts == first for counts in later)  # new learning rates: no graph, no recompile


def test_the_gram_form_by_blocks_compiles_into_one_graph_of_the_eager_bits() -> None:
    """The Gram iteration with its symmetric products by blocks in float32, on a stack of tall
    matrices (batched, iterated transposed), three steps with the Gram form's restart among them:
    with the training test's standard form (plain products, bf16) every piece of the four forms.
    Traced whole (``fullgraph=True``) and run as the ATen graph that inductor would compile."""
    matrix = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(2))
    arguments = (matrix, PRESETS["polar_express"], 3, 1e-7, torch.float32, "gram-symmetric")
    traced = compile_function(ns._steps, GRAPHS, fullgraph=True, dynamic=False, backend="aot_eager")
    before = compile_counts()
    with mock.patch.object(ns, "compiled", lambda function: traced):
        result = ns.newton_schulz(*arguments, compile=True)
    assert compile_counts()["graphs"] - before["graphs"] == 1
    assert result.dtype == torch.float32 and torch.equal(result, ns.newton_schulz(*arguments))
    assert compile_counts()["graph_breaks"] == before["graph_breaks"]


def test_a_compiled_function_takes_a_graph_for_each_of_many_shapes() -> None:
    # More shapes than dynamo's default limit of 8 graphs per function, each compiled (past the
    # limit, fullgraph=True would raise). The "eager" backend traces as inductor's does and
    # generates no code: fast.
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    function = compile_function(double, 16, fullgraph=True, dynamic=False, backend="eager")
    before = compile_counts()
    for size in range(1, 13):
        assert torch.equal(function(torch.ones(size)), torch.full((size,), 2.0))
    after = compile_counts()
    assert after["graphs"] - before["graphs"] == 12
    assert after["graph_breaks"] == before["graph_breaks"]


def test_auto_compiles_on_cuda_only_and_the_setting_is_checked() -> None:
    assert compiles("auto", torch.device("cuda")) and not compiles("auto", torch.device("cpu"))
    assert compiles(True, torch.device("cpu")) and not compiles(False, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"\(muon\): compile must be True, False or 'auto', got 'yes'"):
        lc.Muon([torch.nn.Parameter(torch.ones(2, 2))], compile="yes")
