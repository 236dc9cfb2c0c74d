"""Hugging Face ``transformers`` models under `CanzonaStrategy`, with the model's own declarations.

A ``PreTrainedModel`` declares how it splits over tensor parallelism (``model._tp_plan``: module
name patterns mapped to strings such as ``"colwise"``; the base model's part comes from
``config.base_model_tp_plan``) and which modules must stay whole (``_no_split_modules``: its
decoder layers, which FSDP wraps one by one). This module turns the first into torch
``ParallelStyle``\\ s and the second into FSDP2 units, so that a LightningModule holding such a
model needs neither a hand-written plan nor ``configure_model``.

Nothing here imports ``transformers``: a model is recognised by its class hierarchy, so the
package works, and imports fast, without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


class HeadNormParallel(ParallelStyle):
    """A norm applied to each attention head, with the heads split over tensor parallelism.

    Its input is ``(…, heads, head_dim)`` with this rank's heads only; its weight (over
    ``head_dim``) is the same on every rank, but each rank's gradient comes from its own heads.
    The weight becomes a replicated DTensor and the input is marked as sharded on the heads
    dimension, so autograd sums the weight's gradient over the TP ranks: ``transformers``'
    ``"replicated_with_grad_allreduce"`` (Qwen3's ``q_norm`` and ``k_norm``). Left plain, each TP
    rank would train the norm on its heads only, and the replicas would drift apart.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(  # no partition_fn: every parameter is replicated
            module, device_mesh, input_fn=_mark_heads_sharded, output_fn=_to_local
        )


def _mark_heads_sharded(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    hidden, *rest = inputs
    if not isinstance(hidden, Tensor) or hidden.ndim < 2:
        raise ValueError(
            f"{type(module).__name__} under 'replicated_with_grad_allreduce' expects a (…, heads, "
            f"head_dim) tensor, got {type(hidden).__name__} of shape {getattr(hidden, 'shape', None)}."
        )
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Shard(hidden.ndim - 2)], run_check=False)
    return (hidden, *rest)


def _to_local(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


#: ``transformers`` TP plan strings and the torch styles that do the same on DTensors.
STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    # The output head: split over the vocabulary, every rank gets the whole logits.
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    # An embedding split over the vocabulary: each rank looks up its rows, the sum is taken.
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": HeadNormParallel,
}

#: Config fields that tensor parallelism splits: colwise projections split heads, experts, and the
#: feed-forward width.
SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size")


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (without importing transformers)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


def transformers_models(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The outermost ``transformers`` models inside ``module`` (itself included), with their names."""
    inside: set[int] = set()
    for name, child in module.named_modules():
        if id(child) not in inside and is_transformers_model(child):
            inside.update(id(m) for m in child.modules())
            yield name, child


def tensor_parallel_plan(module: nn.Module) -> dict[str, ParallelStyle]:
    """The TP plan that the ``transformers`` models inside ``module`` declare, as torch styles.

    Keys are module name patterns relative to ``module`` (``model.model.layers.*.self_attn.q_proj``
    for a ``Qwen3ForCausalLM`` held as ``self.model``).

    Raises:
        ValueError: An entry has a style that has no torch equivalent here (mixture-of-experts
            entries such as ``"packed_colwise"`` among them), naming every such entry.
    """
    plan: dict[str, ParallelStyle] = {}
    unsupported: dict[str, str] = {}
    for prefix, model in transformers_models(module):
        declared = getattr(model, "_tp_plan", None) or {}
        for pattern, style in declared.items():
            name = f"{prefix}.{pattern}" if prefix else pattern
            if style in STYLES:
                plan[name] = STYLES[style]()
            else:
                unsupported[name] = style
    if unsupported:
        raise ValueError(
            f"The tensor-parallel plan of the transformers model has entries that lightning_canzona "
            f"cannot honour: {unsupported} (supported: {sorted(STYLES)}). Train it with "
            "tensor_parallel_size=1 (FSDP2 only), or override configure_model and parallelize it "
            "yourself."
        )
    return plan


def fsdp_unit_classes(module: nn.Module) -> set[str]:
    """Class names that the ``transformers`` models inside ``module`` keep whole (their
    ``_no_split_modules``: decoder layers): each instance is an FSDP2 unit of its own."""
    names: set[str] = set()
    for _, model in transformers_models(module):
        names.update(getattr(model, "_no_split_modules", None) or ())
    return names


def check_tensor_parallel_size(module: nn.Module, tensor_parallel_size: int) -> None:
    """Fail clearly when ``tensor_parallel_size`` does not divide what the TP plan splits.

    Raises:
        ValueError: Naming the config field, its value, and the sizes that divide every field.
    """
    if tensor_parallel_size == 1:
        return
    for _, model in transformers_models(module):
        config = model.config
        sizes = {f: getattr(config, f) for f in SPLIT_FIELDS if isinstance(getattr(config, f, None), int)}
        for field, size in sizes.items():
            if size % tensor_parallel_size:
                common = math.gcd(*sizes.values())
                working = [d for d in range(1, common + 1) if common % d == 0]
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size} does not divide "
                    f"{type(config).__name__}.{field}={size}: tensor parallelism splits it over the "
                    f"ranks. Sizes that divide {sorted(sizes)}: {working}."
                )
