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

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from fnmatch import fnmatchcase
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_canzona.compat import (
    StridedShard,
    substituted_parameters,
    transformers_no_split_modules,
    transformers_tp_plan,
)


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


class ExpertsParallel(ParallelStyle):
    """Mixture-of-experts experts with every expert split over tensor parallelism
    (``transformers``' ``"moe_tp_experts"``).

    The expert stacks named in ``placements`` become DTensors (``"packed_colwise"`` gives each rank
    a row block of the gate and one of the up projection, ``_StridedShard``); the module's own
    forward then runs on the local blocks: each rank computes its part of every expert's output,
    the parts are summed over TP, and the inputs' gradients (the hidden states, the routing
    weights), partial on each rank, are summed in backward.

    Args:
        placements: The TP placement of each parameter of the module, by name.
    """

    def __init__(self, placements: dict[str, Placement]) -> None:
        super().__init__()
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            param = module.get_parameter(name)
            sharded = distribute_tensor(param.detach(), device_mesh, [placement])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        forward = module.forward

        @functools.wraps(forward)
        def forward_on_local_blocks(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _replicated_inputs(args, kwargs, device_mesh)
            with _local_parameters(module, self.placements):
                output = forward(*args, **kwargs)
            partial = DTensor.from_local(output, device_mesh, [Partial()], run_check=False)
            return partial.redistribute(placements=[Replicate()]).to_local()

        module.forward = forward_on_local_blocks
        return module


def _replicated_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The floating-point inputs, unchanged, but with their gradients summed over ``mesh``."""

    def summed_in_backward(value: Any) -> Any:
        if not isinstance(value, Tensor) or not value.is_floating_point():
            return value
        replicated = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        return replicated.to_local(grad_placements=[Partial()])

    return tuple(map(summed_in_backward, args)), {k: summed_in_backward(v) for k, v in kwargs.items()}


@contextlib.contextmanager
def _local_parameters(module: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """Run ``module`` with the local blocks of its DTensor parameters ``names`` (differentiably)."""
    params = dict(module.named_parameters(recurse=False))
    local = {name: params[name].to_local() for name in names if isinstance(params[name], DTensor)}
    with substituted_parameters(module, local):
        yield


#: ``transformers`` TP plan strings for single parameters (of an experts module) and their
#: placement, by the parameter's number of dimensions.
PARAMETER_PLACEMENTS: dict[str, Callable[[int], Placement]] = {
    "colwise": lambda ndim: Shard(ndim - 2),
    "rowwise": lambda ndim: Shard(ndim - 1),
    "packed_colwise": lambda ndim: StridedShard(ndim - 2, split_factor=2),
    "packed_rowwise": lambda ndim: StridedShard(ndim - 1, split_factor=2),
}


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
    for a ``Qwen3ForCausalLM`` held as ``self.model``). Entries that name a parameter (an expert
    stack, ``…experts.gate_up_proj``) give its placement to the style of its module
    (`ExpertsParallel`).

    Raises:
        ValueError: An entry has a style that has no torch equivalent here, or names a parameter
            whose module has no experts style, naming every such entry.
    """
    plan: dict[str, ParallelStyle] = {}
    unsupported: dict[str, str] = {}
    for prefix, model in transformers_models(module):
        declared = transformers_tp_plan(model)
        placements: dict[str, dict[str, Placement]] = {}
        for pattern, style in list(declared.items()):
            parent, _, name = pattern.rpartition(".")
            ndim = _parameter_ndim(model, parent, name)
            if ndim is not None and style in PARAMETER_PLACEMENTS:
                placements.setdefault(parent, {})[name] = PARAMETER_PLACEMENTS[style](ndim)
                del declared[pattern]
        # A model class declares one plan for all its configs: entries for the layers that this
        # config does not build (dense feed-forwards of a model whose layers are all sparse) apply
        # to nothing, as in transformers.
        module_names = [name for name, _ in model.named_modules()]
        for pattern, style in declared.items():
            if not any(fnmatchcase(name, pattern) for name in module_names):
                continue
            name = f"{prefix}.{pattern}" if prefix else pattern
            if style == "moe_tp_experts":
                plan[name] = ExpertsParallel(placements.pop(pattern, {}))
            elif style in STYLES:
                plan[name] = STYLES[style]()
            else:
                unsupported[name] = style
        for parent, params in placements.items():  # parameters without an experts style
            for param in params:
                unsupported[f"{prefix}.{parent}.{param}" if prefix else f"{parent}.{param}"] = "parameter"
    if unsupported:
        raise ValueError(
            f"The tensor-parallel plan of the transformers model has entries that lightning_canzona "
            f"cannot honour: {unsupported} (supported: {sorted(STYLES) + ['moe_tp_experts']}, and "
            f"{sorted(PARAMETER_PLACEMENTS)} for the parameters of a 'moe_tp_experts' module). "
            "Train it with tensor_parallel_size=1 (FSDP2 only), or override configure_model and "
            "parallelize it yourself."
        )
    return plan


def _parameter_ndim(model: nn.Module, parent: str, name: str) -> int | None:
    """The dimensions of parameter ``name`` of the modules matching ``parent`` (``None``: the
    pattern names modules, not a parameter)."""
    for module_name, child in model.named_modules():
        params = dict(child.named_parameters(recurse=False))
        if fnmatchcase(module_name, parent) and name in params:
            return params[name].ndim
    return None


def fsdp_unit_classes(module: nn.Module) -> set[str]:
    """Class names that the ``transformers`` models inside ``module`` keep whole (their
    ``_no_split_modules``: decoder layers): each instance is an FSDP2 unit of its own."""
    names: set[str] = set()
    for _, model in transformers_models(module):
        names.update(transformers_no_split_modules(model))
    return names


def split_sizes(module: nn.Module) -> dict[str, int]:
    """The config fields that the TP plans of the ``transformers`` models inside ``module``
    split over the ranks (heads, the feed-forward widths), as ``{"Qwen3Config.num_key_value_heads":
    2, …}``: a tensor-parallel size must divide each."""
    sizes: dict[str, int] = {}
    for _, model in transformers_models(module):
        config = model.config
        for field in SPLIT_FIELDS:
            value = getattr(config, field, None)
            if isinstance(value, int) and not isinstance(value, bool):
                sizes[f"{type(config).__name__}.{field}"] = value
    return sizes
