"""Every private name of torch, Lightning and torchmetrics that the package uses, in one place.

Each is a break waiting for the next release, so each is reached through this module only, with
the public API that would replace it and the versions it was checked on: torch 2.10 and 2.13,
Lightning 2.6.1 and 2.6.6, jsonargparse 4.39 and 4.53 (the floors and the newest; CI runs the
suite on both). A test keeps private names of those libraries out of every other module
(``tests/unit/test_layers.py``).

Not here: the hooks and attributes that a Lightning strategy or launcher subclass overrides or
sets on itself (``_configure_launcher``, ``_launcher``, ``_device_mesh``,
``_data_parallel_size``…, ``_wrapping_function``, ``_collect_rank_zero_results``): they are the
subclassing surface that Lightning's own strategies use, and live with the subclasses.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.fabric.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as _FabricMultiProcessingLauncher,
)
from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.model_parallel import _align_compiled_param_names_with_module
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "BackwardSyncControl",
    "FabricMultiProcessingLauncher",
    "PYTREE_MODULE_PATTERN",
    "REDISTRIBUTE_LOGGER",
    "MultiProcessingLauncher",
    "PathLike",
    "StridedShard",
    "SubprocessScriptLauncher",
    "WorkerOutput",
    "align_compiled_param_names",
    "detached_from_trainer",
    "check_option_values_with",
    "compile_counts",
    "compile_function",
    "data_version",
    "foreach_add_",
    "foreach_addcdiv_",
    "foreach_addcmul_",
    "foreach_div_",
    "foreach_lerp",
    "foreach_lerp_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_sqrt",
    "local_shape",
    "materialize_distributed_module",
    "nested_option",
    "optimizers_to_device",
    "flatten_mesh",
    "root_mesh",
    "set_device_mesh",
    "should_update_logs",
    "substituted_parameters",
    "track_optimizer_steps",
    "transformers_no_split_modules",
    "transformers_tp_plan",
    "use_count",
]

# --- torch ------------------------------------------------------------------------------------

#: The placement of transformers' packed (gate ∥ up) projections: several runs of a dimension per
#: rank. Public alternative: none yet (``Shard`` describes one run).
StridedShard = _StridedShard


def local_shape(shape: torch.Size, mesh: DeviceMesh, placements: Any) -> tuple[int, ...]:
    """The shape of this rank's block of a DTensor of ``shape`` placed ``placements`` on ``mesh``.

    Public alternative: none that works without the tensor (``DTensor.to_local().shape`` needs it).
    """
    shape_here, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(shape_here)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dimensions as one, named ``name`` and reachable by it from the root mesh
    (``root[name]``), as torchtitan flattens its HSDP dimensions into ``dp``.

    Public alternative: none yet (``DeviceMesh._flatten``).
    """
    return mesh._flatten(name)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh that ``mesh`` was sliced from (itself if it was not).

    Public alternative: none yet (torch keeps the slice's parent private).
    """
    return mesh._get_root_mesh()


def use_count(tensor: Tensor) -> int:
    """References to ``tensor``'s C++ object, as ``torch.utils.swap_tensors`` reads them.

    Public alternative: none (Python's ``sys.getrefcount`` sees the Python object only).
    """
    return tensor._use_count()


def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU has bfloat16 matrix instructions (AVX512-BF16 or AMX), which oneDNN uses
    for bfloat16 matmuls; without them torch runs bfloat16 matmuls 20-50 times slower than float32.

    Public alternative: none (``torch.backends.cpu.get_cpu_capability`` names the vector width
    only).
    """
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def data_version(tensor: Tensor) -> int:
    """The count of in-place changes of ``tensor``'s data (autograd's version counter).

    Public alternative: none.
    """
    return tensor._version


#: One kernel launch per operation over lists of tensors, as torch.optim's ``foreach``
#: implementations. Public alternative: none (``torch._foreach_*`` is what torch.optim calls).
foreach_add_ = torch._foreach_add_
foreach_addcdiv_ = torch._foreach_addcdiv_
foreach_addcmul_ = torch._foreach_addcmul_
foreach_div_ = torch._foreach_div_
foreach_lerp = torch._foreach_lerp
foreach_lerp_ = torch._foreach_lerp_
foreach_mul_ = torch._foreach_mul_
foreach_norm = torch._foreach_norm
foreach_sqrt = torch._foreach_sqrt


@contextlib.contextmanager
def substituted_parameters(module: nn.Module, tensors: Mapping[str, Tensor]) -> Iterator[None]:
    """Within the block, ``module``'s own parameters ``tensors`` are replaced by those tensors.

    Public alternative: ``torch.func.functional_call``, which takes the call instead of a block
    and substitutes through every submodule.
    """
    held = {name: module._parameters[name] for name in tensors}
    try:
        module._parameters.update(tensors)
        yield
    finally:
        module._parameters.update(held)


def compile_function(function: Callable[..., Any], graphs: int, **options: Any) -> Callable[..., Any]:
    """``torch.compile(function, **options)``, allowed ``graphs`` graphs (one per guard failure:
    a new shape under ``dynamic=False``) before dynamo stops compiling it.

    Public alternative: ``torch.compile(recompile_limit=...)`` (torch 2.12 on), used where torch
    takes it; before that, dynamo's process-wide limit (``torch._dynamo.config.recompile_limit``)
    raised while the compiled function runs.
    """
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(function, recompile_limit=graphs, **options)
    compiled = torch.compile(function, **options)

    @functools.wraps(function)
    def within_limit(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(recompile_limit=graphs):
            return compiled(*args, **kwargs)

    return within_limit


def compile_counts() -> dict[str, int]:
    """What ``torch.compile`` did in this process so far: ``"graphs"`` compiled (a recompile
    after a guard failed, a new shape's, included) and ``"graph_breaks"``. Public alternative:
    none (``torch._logging`` prints them; dynamo counts them here).
    """
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


#: The logger of DTensor's redistribution (see `warning_filters.SequentialGathers`).
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"

# --- transformers ---------------------------------------------------------------------------------


def transformers_tp_plan(model: nn.Module) -> dict[str, str]:
    """A ``PreTrainedModel``'s tensor-parallel plan: its base model's (``config.base_model_tp_plan``)
    and its head's, by module pattern (``{}`` for none). Public alternative: the config's covers
    the base model only. Checked on transformers 5.25 (the floors step runs without it)."""
    return dict(getattr(model, "_tp_plan", None) or {})


def transformers_no_split_modules(model: nn.Module) -> tuple[str, ...]:
    """The module classes that a ``PreTrainedModel`` keeps whole when it splits itself over
    devices (its decoder layers). Public alternative: none."""
    return tuple(getattr(model, "_no_split_modules", None) or ())


def transformers_attention_implementation(model: nn.Module) -> str:
    """The attention function a ``PreTrainedModel`` dispatches to (``"sdpa"``, ``"eager"``, …).
    Public alternative: ``set_attn_implementation`` sets it; nothing public reads it."""
    return model.config._attn_implementation


# --- Lightning ----------------------------------------------------------------------------------

#: A path as Lightning's hooks take it (Lightning's own alias, ``_PATH``, is private).
PathLike = str | os.PathLike[str]

#: How Fabric's ``no_backward_sync`` asks a strategy to skip gradient synchronisation
#: (`lightning_canzona.fabric`). Public alternative: none (Fabric exports no base to extend).
BackwardSyncControl = _BackwardSyncControl

#: The launchers that the package's own extend (`lightning_canzona.launcher`). Public
#: alternative: none (Lightning exports no launcher base to extend).
SubprocessScriptLauncher = _SubprocessScriptLauncher
MultiProcessingLauncher = _MultiProcessingLauncher
WorkerOutput = _WorkerOutput
FabricMultiProcessingLauncher = _FabricMultiProcessingLauncher

#: The module of Lightning's batch flattening, which warns on torch 2.13 (`warning_filters`).
PYTREE_MODULE_PATTERN = r"lightning\.pytorch\.utilities\._pytree"


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Materialise the meta-device parameters of a sharded module on ``device`` and run their
    ``reset_parameters``, as ``ModelParallelStrategy.setup`` does. Public alternative: none."""
    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move the optimizers' state to ``device``, as Lightning's strategies do. Public
    alternative: none."""
    _optimizers_to_device(optimizers, device)


def align_compiled_param_names(state_dict: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """An optimizer state dict keyed as ``module``'s parameters even where ``torch.compile``
    renamed them. Public alternative: none."""
    return _align_compiled_param_names_with_module(state_dict, module)


def set_device_mesh(module: Any, mesh: DeviceMesh) -> None:
    """Give a LightningModule its ``device_mesh`` (which ``ModelParallelStrategy`` sets before
    ``configure_model``). Public alternative: none (the property has no setter)."""
    module._device_mesh = mesh


@contextlib.contextmanager
def detached_from_trainer(module: Any) -> Iterator[None]:
    """A LightningModule with no trainer attached meanwhile: code that reads ``self.trainer``
    fails at once instead of acting on the trainer. Public alternative: none (the property raises
    while no trainer is attached, so the attached one cannot be read to be restored)."""
    trainer = module._trainer
    module.trainer = None
    try:
        yield
    finally:
        module.trainer = trainer


def should_update_logs(trainer: Any) -> bool:
    """Whether the Trainer logs at this step (``log_every_n_steps``, the end of the run).

    Public alternative: none (``Trainer.log_every_n_steps`` alone misses the last step and
    accumulation).
    """
    return trainer._logger_connector.should_update_logs


def track_optimizer_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as a learning-rate scheduler's ``__init__`` does, so that the
    scheduler's check of the call order sees its calls. Public alternative: none."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]


# --- jsonargparse (LightningCLI's parser) ---------------------------------------------------------


def check_option_values_with(parser: Any, option: str, prepare: Callable[[Any, Any], Any]) -> None:
    """Pass every value of ``option`` that ``parser`` checks against the option's type (from the
    command line, a config file, or a nested option such as ``--option.key``: see `nested_option`)
    through ``prepare(value, config)`` first, and check what it returns. ``config`` is the
    namespace the value is merged into, or None; ``prepare`` may replace what it holds under the
    option. Public alternative: none (``ActionTypeHint._check_type``, whose keywords
    ``_check_type_`` reads from its signature: hence ``functools.wraps``)."""
    action = parser._option_string_actions[option]
    check = action._check_type

    @functools.wraps(check)
    def prepared_check(value: Any, *args: Any, **kwargs: Any) -> Any:
        return check(prepare(value, kwargs.get("cfg")), *args, **kwargs)

    action._check_type = prepared_check


def nested_option(value: Any) -> tuple[str, Any] | None:
    """``(key, value)`` of a nested option (``--option.key value``) as the option's type check
    gets it, or None for any other value. Public alternative: none (``NestedArg``)."""
    from jsonargparse._util import NestedArg

    return (value.key, value.val) if isinstance(value, NestedArg) else None
