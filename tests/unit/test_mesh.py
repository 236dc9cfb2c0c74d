"""The mesh rule (`lightning_canzona.mesh.choose_mesh`): "auto" sizes a model can take, explicit
sizes kept and checked, each refusal naming the setting and what would work."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_canzona.mesh import BYTES_PER_PARAMETER, auto_replicas, choose_mesh
from lightning_canzona.models import CausalLanguageModel


def _sizes(module, dp="auto", tp="auto", nodes=1, per_node=4, composes=True) -> tuple[int, int]:
    shape = choose_mesh(module, dp, tp, nodes, per_node, composes)
    return shape.data_parallel_size, shape.tensor_parallel_size


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_auto_takes_the_largest_tensor_parallel_size_the_heads_allow(preset) -> None:
    module = CausalLanguageModel(preset)  # 4 query heads, 2 key/value heads
    shape = choose_mesh(module, "auto", "auto", 1, 4)
    assert (shape.data_parallel_size, shape.tensor_parallel_size) == (2, 2)
    assert "tensor_parallel_size 4 would not divide Qwen3Config.num_key_value_heads=2" in shape.describe()
    assert _sizes(module, per_node=2) == (1, 2)
    assert _sizes(module, per_node=8) == (4, 2)
    assert _sizes(module, per_node=1) == (1, 1)
    assert _sizes(module, nodes=2, per_node=4) == (4, 2)  # tensor parallelism stays within a node
    assert _sizes(module, per_node=6) == (3, 2)


def test_the_mesh_line_says_which_collectives_cross_nodes() -> None:
    module = CausalLanguageModel("tiny")
    assert "Across" not in choose_mesh(module, "auto", "auto", 1, 4).describe()
    two_nodes = choose_mesh(module, "auto", "auto", 2, 2).describe()
    assert two_nodes.endswith(
        "Across nodes: FSDP2's all-gathers and reduce-scatters (data_parallel), the optimizer's gathers "
        "and scatters; within each node: tensor_parallel."
    )
    split = choose_mesh(module, 1, 2, 2, 1).describe()  # one device a node: TP between them
    assert (
        "Across nodes: every layer's tensor-parallel collectives (tensor_parallel), the optimizer's" in split
    )
    assert "(a tensor_parallel_size that divides the 1 devices per node keeps them in one)" in split
    # HSDP, a replica a node: only the gradients' all-reduce (and the optimizer) crosses.
    hsdp = choose_mesh(module, "auto", 2, 2, 4, replicate_size=2)
    assert hsdp.dimensions() == {"data_parallel_replicate": 2, "data_parallel_shard": 2, "tensor_parallel": 2}
    assert "device mesh data_parallel 4 (replicate 2 × shard 2) × tensor_parallel 2" in hsdp.describe()
    assert hsdp.describe().endswith(
        "Across nodes: HSDP's all-reduces of gradients (data_parallel_replicate), the optimizer's gathers "
        "and scatters where its plan spreads over the replicas (the plan report says); within each "
        "node: data_parallel_shard, tensor_parallel."
    )


def test_a_replicate_size_must_divide_the_data_parallel_size() -> None:
    module = CausalLanguageModel("tiny")
    with pytest.raises(
        ValueError, match=r"data_parallel_replicate_size=3 does not divide the data-parallel size 2 "
    ):
        choose_mesh(module, "auto", "auto", 1, 4, replicate_size=3)
    # Without the model (the Trainer's first check), "auto" sizes are unknown: only the devices count.
    assert choose_mesh(None, "auto", "auto", 1, 4, replicate_size=2).replicate_size == 2
    with pytest.raises(ValueError, match=r"data_parallel_replicate_size=3 does not divide the 4 devices"):
        choose_mesh(None, "auto", "auto", 1, 4, replicate_size=3)
    with pytest.raises(ValueError, match="a positive integer or 'auto', got 0"):
        choose_mesh(module, "auto", "auto", 1, 4, replicate_size=0)


def test_auto_replicas_are_a_replica_a_node_where_a_node_holds_the_model() -> None:
    """``"auto"``: one replica until the ranks know the devices' memory; then a replica a node
    where the model at 16 bytes a parameter takes at most half of a node's memory."""
    module = CausalLanguageModel("tiny")
    parameters = sum(p.numel() for p in module.parameters())
    shape = choose_mesh(module, "auto", "auto", 2, 4, replicate_size="auto")
    assert (shape.data_parallel_size, shape.tensor_parallel_size, shape.replicate_size) == (4, 2, 1)
    fits = auto_replicas(shape, 2, parameters, 2 * BYTES_PER_PARAMETER * parameters)
    assert (fits.replicate_size, fits.shard_size) == (2, 2)
    assert "data_parallel_replicate_size 'auto': 2, a replica a node (the model's" in fits.describe()
    too_large = auto_replicas(shape, 2, parameters, 2 * BYTES_PER_PARAMETER * parameters - 1)
    assert too_large.replicate_size == 1 and "would take over half of a node's" in too_large.reason
    assert "no parameters yet" in auto_replicas(shape, 2, 0, 10**12).reason
    within = choose_mesh(module, 4, 2, 4, 2, replicate_size="auto")  # TP over a node's 2 devices
    assert auto_replicas(within, 4, parameters, 10**12).replicate_size == 4
    across = choose_mesh(module, 1, 2, 2, 1, replicate_size="auto")  # TP across the 2 nodes
    assert "tensor parallelism spans nodes" in auto_replicas(across, 2, parameters, 10**12).reason
    assert auto_replicas(choose_mesh(module, "auto", "auto", 1, 4), 1, parameters, 10**12) == choose_mesh(
        module, "auto", "auto", 1, 4
    )


def test_explicit_sizes_are_kept_and_checked_against_the_model() -> None:
    module = CausalLanguageModel("tiny")
    assert _sizes(module, dp=4, tp=1) == (4, 1)
    assert _sizes(module, tp=1) == (4, 1)  # the other size fills the devices
    assert _sizes(module, dp=2) == (2, 2)
    assert "as given" in choose_mesh(module, 2, 2, 1, 4).reason
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=4 does not divide Qwen3Config\.num_key_value_heads=2.*\[1, 2\]",
    ):
        choose_mesh(module, "auto", 4, 1, 4)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=4 does not divide Qwen3Config\.num_key_value_heads=2"
    ):
        choose_mesh(module, 1, "auto", 1, 4)  # data_parallel_size=1 leaves 4 to tensor parallelism
    with pytest.raises(
        ValueError, match=r"data_parallel_size=2 × tensor_parallel_size=1 is not the 4 devices"
    ):
        choose_mesh(module, 2, 1, 1, 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the 4 devices"):
        choose_mesh(None, "auto", 3, 1, 4)
    with pytest.raises(ValueError, match=r"data_parallel_size=True does not divide"):
        choose_mesh(None, True, "auto", 1, 4)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


class WithPlan(Plain):
    """A plan but no declared constraints: the widths its plan splits are the constraints."""

    def tensor_parallel_plan(self) -> dict:
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}


class WithPlanAndHeads(WithPlan):
    def tensor_parallel_constraints(self) -> dict[str, int]:
        return {"num_heads": 3}


class ParallelizesItself(Plain):
    def configure_model(self) -> None:  # (composes=False below: the strategy leaves it alone)
        pass


def test_a_module_without_a_plan_is_data_parallel_and_refuses_tensor_parallelism() -> None:
    shape = choose_mesh(Plain(), "auto", "auto", 1, 4)
    assert (shape.data_parallel_size, shape.tensor_parallel_size) == (4, 1)
    assert "Plain declares no tensor-parallel plan" in shape.reason
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 but Plain declares no tensor_parallel_plan"
    ):
        choose_mesh(Plain(), "auto", 2, 1, 4)


def test_the_widths_a_plan_splits_and_declared_head_counts_limit_auto() -> None:
    assert _sizes(WithPlan()) == (1, 4)  # 12 and 12 split over 4
    assert _sizes(WithPlan(), per_node=8) == (2, 4)  # 8 would not divide up.out_features=12
    assert _sizes(WithPlanAndHeads()) == (4, 1)  # 3 heads: no size above 1 divides them
    shape = choose_mesh(WithPlanAndHeads(), "auto", "auto", 1, 4)
    assert "tensor_parallel_size 2 would not divide num_heads=3, so FSDP2 over every device" in shape.reason
    with pytest.raises(ValueError, match=r"does not divide up\.out_features=12"):
        choose_mesh(WithPlan(), "auto", 8, 1, 8)


def test_a_module_that_parallelizes_itself_gets_lightnings_auto_unless_it_declares_constraints() -> None:
    assert _sizes(ParallelizesItself(), composes=False) == (1, 4)  # tp = devices per node
    assert _sizes(ParallelizesItself(), nodes=2, composes=False) == (2, 4)
    declared = ParallelizesItself()
    declared.tensor_parallel_constraints = lambda: {"num_kv_heads": 2}
    assert _sizes(declared, composes=False) == (2, 2)
    with pytest.raises(ValueError, match=r"does not divide num_kv_heads=2"):
        choose_mesh(declared, 1, 4, 1, 4, composes=False)
