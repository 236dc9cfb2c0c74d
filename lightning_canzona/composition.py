"""Tensor parallelism, then FSDP2, applied to a module that declares its TP plan.

The contract: a module declares ``tensor_parallel_plan() -> {module name pattern: ParallelStyle}``
(names relative to itself). `compose` applies that plan on the mesh's ``tensor_parallel``
dimension, then ``fully_shard`` over its ``data_parallel`` dimension (`sharding_mesh`: HSDP's two
where the mesh has replicas) on its FSDP2 units, each after the units inside it (experts before
their block), as FSDP2 requires. A module that holds a Hugging Face ``transformers`` model needs no
plan of its own: the model's (and its decoder layers as units) are used
(`lightning_canzona.huggingface`).


- **units** are the children of ``module`` and of every module without a ``forward`` of its own
  (``nn.ModuleList``, ``nn.ModuleDict``: the transformer blocks, the experts inside them, a dict
  of heads), when they have a ``forward`` and parameters that no unit inside them manages; each
  one's parameters are then gathered only while it runs;
- never a unit: ``module`` itself (Lightning calls ``training_step``, not ``module.forward``, so
  FSDP2's hooks would never gather its parameters), a module without ``forward`` (its hooks would
  never run), and a module FSDP2 already manages, with everything inside it;
- left **plain** (not sharded; `CanzonaStrategy` averages their gradients and keeps the replicas
  equal): parameters set on ``module`` itself or on a container outside every unit, scalars
  (FSDP2 shards along a dimension), and parameters shared by modules of different units (a weight
  tied across units: sharding it in one unit would untie it from the other).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, TypedDict

from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_canzona import huggingface
from lightning_canzona.compat import flatten_mesh, transformers_tp_plan
from lightning_canzona.warning_filters import ignore_view_warning_of_unresharded_root

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


def compose(
    module: nn.Module,
    device_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    compile_options: Mapping[str, Any] | None = None,
) -> None:
    """Parallelize ``module`` in place on a ``(data_parallel, tensor_parallel)`` mesh.

    Args:
        module: The model (a LightningModule, or any module).
        device_mesh: A mesh with ``data_parallel`` and ``tensor_parallel`` dimensions.
        mp_policy: FSDP2's mixed precision for every unit (``None``: compute, all-gather and
            reduce in the parameters' dtype).
        compile_options: Compile each block (`_Units.blocks`) in place with these
            ``torch.compile`` keywords (``nn.Module.compile``), after tensor parallelism and
            before FSDP2, as torchtitan does: dynamo traces the block's ``forward``, one graph
            serves every block of a class, FSDP2's gathers and TP's hooks run outside it, names
            and state dicts stay the module's, and a copy of the model is eager. ``None``: eager.

    Raises:
        ValueError: See `check_composable`.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh = device_mesh["tensor_parallel"]
    plan = check_composable(module, tp_mesh.size())
    if plan:
        # Applied even on a one-rank TP mesh: parameters then live on the same meshes at every
        # mesh shape, so optimizer param groups, and checkpoints, keep one structure.
        tied = _tied_parameters(module)
        parallelize_module(module, tp_mesh, plan)
        _tie_again(tied)
    options = {} if mp_policy is None else {"mp_policy": mp_policy}
    units = _choose_units(module)
    if compile_options is not None:
        for block in units.blocks():
            block.compile(**compile_options)
    if len(units.roots) == 1:  # kept gathered from forward to backward (`_Units.reshard_after_forward`)
        ignore_view_warning_of_unresharded_root(type(units.roots[0]))
    for unit in units.modules:
        fully_shard(
            unit,
            mesh=sharding_mesh(device_mesh),
            reshard_after_forward=units.reshard_after_forward(unit),
            ignored_params=units.left_plain_in(unit),
            **options,
        )


class CompileOptions(TypedDict, total=False):
    """The ``torch.compile`` keywords that the strategies' ``compile`` setting takes (a config's
    misspelt key is refused when it is read)."""

    fullgraph: bool
    dynamic: bool | None
    backend: str
    mode: str | None
    options: dict[str, Any] | None
    disable: bool


def compile_options(setting: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``torch.compile`` keywords of a strategy's ``compile`` setting, checked; ``None``: eager.

    Raises:
        TypeError: ``setting`` is neither a bool nor a mapping.
        ValueError: A keyword that is not one of `CompileOptions`, named with the ones that are.
    """
    if isinstance(setting, bool):
        return {} if setting else None
    if not isinstance(setting, Mapping):
        raise TypeError(f"compile must be True, False or a dict of torch.compile's keywords, got {setting!r}")
    taken = list(CompileOptions.__annotations__)
    unknown = [name for name in setting if name not in taken]
    if unknown:
        raise ValueError(
            f"compile={dict(setting)!r}: torch.compile takes no {unknown[0]!r}; it takes {', '.join(taken)}."
        )
    return dict(setting)


def compile_of_own_composition(setting: str, composer: str) -> ValueError:
    """The error for a ``compile`` setting (``setting``) on a model that ``composer`` composes."""
    return ValueError(
        f"{setting} compiles the blocks of a model the strategy composes, and {composer} composes its "
        "own: pass compile_options to lightning_canzona.composition.compose there, or compile its "
        "blocks itself (block.compile()); or leave compile unset."
    )


def sharding_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``fully_shard`` takes: ``data_parallel``, or with replicas (HSDP) its
    ``(data_parallel_replicate, data_parallel_shard)`` dimensions, over whose first FSDP2
    replicates and over whose second it shards."""
    if "data_parallel_replicate" in (device_mesh.mesh_dim_names or ()):
        return device_mesh["data_parallel_replicate", "data_parallel_shard"]
    return device_mesh["data_parallel"]


def data_parallel_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh's ``data_parallel`` dimension: with replicas (HSDP), its two data-parallel
    dimensions flattened, taken from where they were flattened (torch deprecates slicing a
    flattened dimension from the root mesh, and warns at each slice)."""
    if "data_parallel_replicate" in (device_mesh.mesh_dim_names or ()):
        return flatten_mesh(sharding_mesh(device_mesh), "data_parallel")
    return device_mesh["data_parallel"]


def sampler_kwargs(device_mesh: DeviceMesh) -> dict[str, int]:
    """A distributed sampler's ``num_replicas`` and ``rank``: the `data_parallel_mesh`'s."""
    mesh = data_parallel_mesh(device_mesh)
    return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}


def check_even_batches(dataloader: object, stage: str) -> None:
    """Refuse a ``dataloader`` whose samples, split over the data-parallel ranks without repeats (as
    Lightning splits ``predict``'s), give the ranks different numbers of batches: every forward
    all-gathers FSDP2's shards on every rank, so a rank with fewer batches would leave the others
    waiting in their last forwards until the process group's timeout.

    Every rank computes every rank's share from the sampler alone, so all raise the same error.

    Raises:
        ValueError: Naming the samples, the batch size, the ranks' batch counts and what works.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)  # Lightning's wrapper copies its fields
    sampler, batch_size = getattr(batch_sampler, "sampler", None), getattr(batch_sampler, "batch_size", None)
    if not (isinstance(sampler, UnrepeatedDistributedSampler) and batch_size):
        return
    samples, ranks = len(sampler.dataset), sampler.num_replicas
    rounding = math.floor if getattr(batch_sampler, "drop_last", False) else math.ceil
    counts = [rounding(len(range(rank, samples, ranks)) / batch_size) for rank in range(ranks)]
    if len(set(counts)) > 1:
        raise ValueError(
            f"trainer.{stage} would give the {ranks} data-parallel ranks different numbers of batches "
            f"({samples} samples in batches of {batch_size}: {', '.join(map(str, counts))}), and each "
            "forward all-gathers FSDP2's shards on every rank: the ranks with more batches would wait "
            "for the others until the timeout. Use a number of samples that gives every rank as many "
            f"batches (any multiple of {ranks * batch_size} = {ranks} ranks × batch_size {batch_size} does)."
        )


def has_tensor_parallel_plan(module: nn.Module) -> bool:
    """Whether ``module`` declares a TP plan: ``tensor_parallel_plan()``, or a ``transformers``
    model's own (see `lightning_canzona.huggingface`)."""
    if callable(getattr(module, "tensor_parallel_plan", None)):
        return True
    return any(transformers_tp_plan(model) for _, model in huggingface.transformers_models(module))


def declared_plan(module: nn.Module, tp_size: int) -> dict[str, Any]:
    """The module's ``tensor_parallel_plan()``; else, at ``tp_size > 1``, the plan of the
    ``transformers`` models it holds."""
    plan_fn = getattr(module, "tensor_parallel_plan", None)
    if callable(plan_fn):
        return plan_fn()
    if tp_size > 1 and has_tensor_parallel_plan(module):
        return huggingface.tensor_parallel_plan(module)
    return {}


def check_composable(module: nn.Module, tp_size: int) -> dict[str, Any]:
    """Everything `compose` needs of ``module`` at a TP size of ``tp_size``, checked without
    changing it or communicating (so before any rank starts); returns the plan.

    Raises:
        ValueError: ``tp_size > 1`` and the module declares no plan; the plan names modules that
            do not exist, or has entries that cannot be honoured (``transformers``); or
            ``tp_size`` does not divide a size that the plan splits (`check_tensor_parallel_size`).
    """
    plan = declared_plan(module, tp_size)
    if tp_size > 1 and not plan:
        raise ValueError(
            f"tensor_parallel_size={tp_size} but {type(module).__name__} declares no "
            'tensor_parallel_plan(): use tensor_parallel_size=1 (or "auto"), add a plan (see '
            "lightning_canzona.models.tensor_parallel_plan), or override configure_model to "
            "parallelize it yourself."
        )
    if plan:
        _check_plan_targets(module, plan)
    check_tensor_parallel_size(module, tp_size)
    return plan


def tensor_parallel_constraints(module: nn.Module) -> dict[str, int]:
    """The sizes that a tensor-parallel size must divide, by name.

    - What ``module.tensor_parallel_constraints()`` declares, where it does: the sizes whose
      split a layer's width does not show, head counts above all (``{"MyConfig.num_kv_heads":
      2}``: a key projection 64 wide splits over 4 ranks, but its 2 heads do not);
    - the config fields that the ``transformers`` models inside it split
      (`huggingface.split_sizes`);
    - the width that each ``nn.Linear`` of its own ``tensor_parallel_plan()`` splits:
      ``out_features`` under ``ColwiseParallel``, ``in_features`` under ``RowwiseParallel``.
    """
    declared = getattr(module, "tensor_parallel_constraints", None)
    constraints = dict(declared()) if callable(declared) else {}
    constraints.update(huggingface.split_sizes(module))
    plan_fn = getattr(module, "tensor_parallel_plan", None)
    if callable(plan_fn):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = plan_fn()
        for name, child in module.named_modules():
            style = next((s for key, s in plan.items() if fnmatchcase(name, key)), None)
            if isinstance(child, nn.Linear) and isinstance(style, ColwiseParallel):
                constraints[f"{name}.out_features"] = child.out_features
            elif isinstance(child, nn.Linear) and isinstance(style, RowwiseParallel):
                constraints[f"{name}.in_features"] = child.in_features
    return constraints


def check_tensor_parallel_size(module: nn.Module, tp_size: int) -> None:
    """Fail clearly when ``tp_size`` does not divide a size that tensor parallelism splits.

    Raises:
        ValueError: Naming the first such size and the TP sizes that divide them all.
    """
    if tp_size == 1:
        return
    constraints = tensor_parallel_constraints(module)
    for name, size in constraints.items():
        if size % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide {name}={size}: tensor parallelism "
                f"splits it over the ranks. Sizes that divide every size the plan splits: "
                f"{dividing_sizes(constraints.values())}."
            )


def dividing_sizes(sizes: Iterable[int], limit: int | None = None) -> list[int]:
    """The positive integers that divide every one of ``sizes`` (and ``limit``, if given)."""
    common = math.gcd(*sizes, *([limit] if limit else []))
    return [d for d in range(1, common + 1) if common % d == 0] if common else [1]


def _tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter that several modules hold (a tied embedding and output head), as the
    ``(module, name)`` places that hold it."""
    places: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for child in module.modules():
        for name, param in child.named_parameters(recurse=False):
            places[id(param)].append((child, name))
    return [held for held in places.values() if len(held) > 1]


def _tie_again(tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Tie again what tensor parallelism untied: each ``ParallelStyle`` gives the modules it
    splits parameters of their own, so a weight tied between an embedding and the output head
    would train as two. Both halves must be split alike (a ``transformers`` model's vocabulary-split
    embedding and head are) to be one parameter again.

    Raises:
        ValueError: The plan splits a tied weight in two different ways, naming its places.
    """
    for places in tied:
        first_module, first_name = places[0]
        kept = getattr(first_module, first_name)
        for child, name in places[1:]:
            other = getattr(child, name)
            if other is kept:
                continue
            layouts = {
                (getattr(p, "device_mesh", None), tuple(getattr(p, "placements", ())), tuple(p.shape))
                for p in (kept, other)
            }
            if len(layouts) > 1:
                raise ValueError(
                    f"The tensor-parallel plan splits a tied weight in two different ways: "
                    f"{type(first_module).__name__}.{first_name} and {type(child).__name__}.{name} "
                    f"({[tuple(getattr(p, 'placements', ())) for p in (kept, other)]}). Split both "
                    "alike (an embedding row-wise and the head column-wise split the vocabulary), or "
                    "leave both out of the plan."
                )
            child.register_parameter(name, kept)


def _check_plan_targets(module: nn.Module, plan: dict[str, Any]) -> None:
    names = [name for name, _ in module.named_modules()]
    missing = [key for key in plan if not any(fnmatchcase(name, key) for name in names)]
    if missing:
        raise ValueError(
            f"The tensor_parallel_plan() of {type(module).__name__} names modules that do not exist: "
            f"{missing}. Module names look like {names[1:4]}…"
        )


@dataclass
class _Units:
    """The modules `compose` shards, in post-order, and the parameters they leave plain."""

    modules: list[nn.Module] = field(default_factory=list)
    #: Parameters each unit holds itself, not through a unit inside it, by ``id`` of the unit.
    holds: dict[int, list[nn.Parameter]] = field(default_factory=dict)
    #: Held by a unit but left plain: scalars, parameters shared with another unit or the outside.
    left_plain: set[nn.Parameter] = field(default_factory=set)
    #: Units inside no other unit: FSDP2 makes each the root of its own forward and backward.
    roots: list[nn.Module] = field(default_factory=list)

    def blocks(self) -> list[nn.Module]:
        """The units whose class recurs (a model's transformer blocks), outside every other such
        unit (a block's experts are compiled as part of their block)."""
        recurring = [unit for unit in self.modules if sum(type(u) is type(unit) for u in self.modules) > 1]
        inside = {id(m) for unit in recurring for m in unit.modules() if m is not unit}
        return [unit for unit in recurring if id(unit) not in inside]

    def left_plain_in(self, unit: nn.Module) -> set[nn.Parameter] | None:
        return {p for p in self.holds[id(unit)] if p in self.left_plain} or None

    def reshard_after_forward(self, unit: nn.Module) -> bool | None:
        """``True`` for one of several roots; ``None`` (FSDP2's choice) otherwise.

        FSDP2 keeps a root's parameters gathered from its forward to its backward, which suits one
        root that runs last. Blocks set directly on the LightningModule are each a root: they
        would all stay gathered through the backward, the memory of an unsharded model.
        """
        return True if len(self.roots) > 1 and any(unit is root for root in self.roots) else None


def _choose_units(module: nn.Module) -> _Units:
    """The FSDP2 units of ``module`` (see the module docstring): each parameter ends up managed
    by exactly one unit, by a module FSDP2 already manages, or by none (plain)."""
    from torch.distributed.fsdp import FSDPModule

    units = _Units()
    # Modules a transformers model keeps whole (its decoder layers) are units wherever they sit.
    whole = huggingface.fsdp_unit_classes(module)

    def visit(node: nn.Module, candidate: bool) -> list[nn.Parameter]:
        """The parameters in ``node``'s subtree that no unit or FSDP2 module inside it manages."""
        if isinstance(node, FSDPModule) or id(node) in units.holds:
            return []
        loose = list(node.parameters(recurse=False))
        # The owner of a container calls its members directly, as a model calls its blocks.
        members_are_candidates = node is module or not _has_forward(node)
        for child in node.children():
            loose += visit(child, members_are_candidates)
        if (candidate or type(node).__name__ in whole) and _has_forward(node) and loose:
            units.modules.append(node)
            units.holds[id(node)] = loose
            return []
        return loose

    units.left_plain = _unshardable(units, outside=visit(module, candidate=False))
    # A unit all of whose parameters stay plain would only add hooks.
    units.modules = [u for u in units.modules if any(p not in units.left_plain for p in units.holds[id(u)])]
    inner = {id(m) for unit in units.modules for m in unit.modules() if m is not unit}
    units.roots = [unit for unit in units.modules if id(unit) not in inner]
    return units


def _unshardable(units: _Units, outside: list[nn.Parameter]) -> set[nn.Parameter]:
    """Scalars, and parameters held by several units or by a unit and the outside."""
    holders: dict[nn.Parameter, set[int | None]] = defaultdict(set)
    for unit in units.modules:
        for param in units.holds[id(unit)]:
            holders[param].add(id(unit))
    for param in outside:
        holders[param].add(None)
    return {param for param, held_by in holders.items() if len(held_by) > 1 or param.ndim == 0}


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward
