"""`CanzonaFabricStrategy`: the package for hand-written training loops on Lightning Fabric.

``Fabric(strategy="canzona")`` composes the model's tensor-parallel plan with FSDP2 on a
``(data_parallel, tensor_parallel)`` mesh chosen for the model, builds and prints the optimizer's
plan, and binds it, as ``Trainer(strategy="canzona")`` does; the two strategies are thin adapters
over the same parts (`lightning_canzona.mesh`, `lightning_canzona.composition`,
`lightning_canzona.preparation`, `lightning_canzona.optim.binding`)::

    fabric = Fabric(strategy="canzona", devices=4)
    fabric.launch()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(lc.Muon(lc.matrix_param_groups(model)))
    # or: model, optimizer = fabric.setup(model, lc.Muon(lc.matrix_param_groups(model)))

The mesh waits for the model: ``"auto"`` sizes are chosen from it when it is set up, so set up
the model before the dataloaders (or give both sizes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_canzona import preparation
from lightning_canzona.checkpoint import (
    IDENTITY_KEY,
    check_before_loading,
    load_distributed,
    load_single_file,
    record,
    save_atomically,
    verify,
    write_state,
)
from lightning_canzona.compat import BackwardSyncControl, PathLike, materialize_distributed_module
from lightning_canzona.composition import (
    CompileOptions,
    compile_of_own_composition,
    compile_options,
    compose,
    data_parallel_mesh,
    sampler_kwargs,
)
from lightning_canzona.config import PlanConfig
from lightning_canzona.distributed.clipping import agreement_of, clip_grad_norm_
from lightning_canzona.elastic import nodes_of_launch
from lightning_canzona.launcher import FabricInProcessLauncher, report_failures_briefly
from lightning_canzona.mesh import MeshShape, choose_mesh
from lightning_canzona.precision import check_precision, mixed_precision_policy

#: Builds the parallel model from the module and the ``(data_parallel, tensor_parallel)`` mesh.
ParallelizeFn = Callable[[nn.Module, DeviceMesh], nn.Module]


class CanzonaFabricStrategy(ModelParallelStrategy):
    """Fabric's FSDP2 × DTensor tensor parallelism with exact, non-redundant Muon, Shampoo and SOAP.

    Args:
        data_parallel_size: Devices per data-parallel group; ``"auto"``: the devices that tensor
            parallelism leaves.
        tensor_parallel_size: Devices per tensor-parallel group; ``"auto"``: the largest size that
            divides the devices per node and every size the model's plan splits, chosen when the
            model is set up (`lightning_canzona.mesh`).
        plan: How each matrix update is planned and run (`lightning_canzona.PlanConfig`), for
            every lightning_canzona optimizer that sets none of its own; one that sets a
            different one is an error. ``None``: each optimizer's own.
        parallelize_fn: Builds the parallel model from the module and the mesh (as Fabric's
            ``ModelParallelStrategy`` takes it); ``None`` composes the model's own tensor-parallel
            plan (or a transformers model's) with FSDP2 (`lightning_canzona.composition`).
        save_distributed_checkpoint: Save one shard per rank (``True``) or one full file.
        verify_checkpoints: Before loading a checkpoint, check every file against the sizes and
            CRC-32 checksums recorded when it was saved: a file cut short or changed is a
            ``CorruptCheckpointError`` naming it on every rank, not wrong weights. ``False``
            skips that read: a file missing, cut short or unreadable is still that error, but
            bytes changed where they still read (inside a tensor) load as they are.
        process_group_backend: ``nccl``, ``gloo``…; ``None`` picks the device's default.
        timeout: Timeout of collective operations.
        start_method: ``popen`` re-runs the script per rank (scripts, torchrun, SLURM); ``fork``
            (notebooks: ``fabric.launch(function)``) or ``spawn`` start the ranks from this
            process, safely after multi-threaded work in it (`lightning_canzona.launcher`).
        data_parallel_replicate_size: Replicas among the data-parallel devices (HSDP): FSDP2
            shards each replica's weights over ``data_parallel_size /
            data_parallel_replicate_size`` devices and all-reduces gradients across the replicas;
            ``"auto"``: a replica a node where one node's devices hold the model
            (`lightning_canzona.CanzonaStrategy`'s).
        compile: Compile each block of the model the strategy composes with ``torch.compile``,
            after tensor parallelism and before FSDP2: ``True``, or a dict of its keywords
            (`lightning_canzona.CanzonaStrategy`'s); not with a ``parallelize_fn`` of your own,
            which compiles what it builds itself.
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        plan: PlanConfig | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        save_distributed_checkpoint: bool = True,
        verify_checkpoints: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "fork", "spawn"] = "popen",
        data_parallel_replicate_size: Literal["auto"] | int = 1,
        compile: bool | CompileOptions = False,
    ) -> None:
        #: ``torch.compile``'s keywords for each block the strategy composes; ``None``: eager.
        self.compile_options = compile_options(compile)
        if parallelize_fn is not None and self.compile_options is not None:
            raise compile_of_own_composition("CanzonaFabricStrategy(compile=...)", "parallelize_fn")
        self.data_parallel_replicate_size = data_parallel_replicate_size
        #: The sizes as given (``"auto"`` or integers); resolved when the model is set up.
        sizes = self._requested_sizes = (data_parallel_size, tensor_parallel_size)
        compose_or_own = parallelize_fn or self._compose
        super().__init__(compose_or_own, *sizes, save_distributed_checkpoint, process_group_backend, timeout)
        if start_method not in ("popen", "fork", "spawn"):
            raise ValueError(f"start_method must be 'popen', 'fork' or 'spawn', got {start_method!r}")
        self.start_method = start_method
        self.plan_config = PlanConfig.given(plan)
        self.verify_checkpoints = verify_checkpoints
        #: The module that `setup_module` composed: what the optimizers' parameters belong to.
        self._module: nn.Module | None = None
        #: Trainable parameters whose gradients the strategy synchronises (`unsharded_parameters`).
        self._plain_parameters: list[tuple[str, nn.Parameter]] = []
        self._optimizers: list[Optimizer] = []
        self._gradient_sync_blocked = False
        self._backward_sync_control = _NoBackwardSync(self)

    def _configure_launcher(self) -> None:
        # Sizes that cannot divide the devices, or a precision it does not support, fail before
        # any process starts (under torchrun or SLURM, as one traceback: rank 0's).
        if self.cluster_environment.creates_processes_externally:
            report_failures_briefly(self.global_rank)
            self.num_nodes = nodes_of_launch(self.cluster_environment, self.num_processes, self.num_nodes)
        self._choose_mesh(None)
        check_precision(self.precision, type(self).__name__)
        if self.start_method != "popen":
            self._launcher = FabricInProcessLauncher(self, self.start_method)
        else:
            super()._configure_launcher()

    def setup_environment(self) -> None:
        """Start the process group; the mesh waits for the model (`setup_module`) unless both
        sizes are given. From here an exception that ends a rank other than 0 prints one line
        (`lightning_canzona.launcher.report_failures_briefly`): a mistake every rank meets, such
        as a model that cannot take the sizes, prints one traceback, rank 0's."""
        preparation.share_cpu_cores(self.root_device, self.num_processes)
        ParallelStrategy.setup_environment(self)  # not ModelParallelStrategy's: it builds the mesh now
        self._setup_distributed()
        report_failures_briefly(self.global_rank)  # after init_process_group, which installs its own
        if "auto" not in self._requested_sizes:
            self._build_mesh(self._choose_mesh(None), None)

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(
                "CanzonaFabricStrategy chooses the mesh for the model: set up the model "
                "(fabric.setup or fabric.setup_module) before anything that needs the mesh, such as "
                "fabric.setup_dataloaders, or give data_parallel_size and tensor_parallel_size."
            )
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data split over the data-parallel ranks (HSDP's replicas and shards together)."""
        return sampler_kwargs(self.device_mesh)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Choose the mesh for ``module`` (once), compose it, and materialize it on the device."""
        preparation.check_not_fsdp1(module, type(self).__name__)
        composes = self._parallelize_fn == self._compose
        # Explicit sizes too are checked against the model (its plan, its head counts).
        shape = self._choose_mesh(module, composes)
        if self._device_mesh is None:
            self._build_mesh(shape, module)
        module = self._parallelize_fn(module, self.device_mesh)
        if not isinstance(module, nn.Module):
            raise TypeError(f"parallelize_fn must return an nn.Module, got {type(module).__name__}")
        materialize_distributed_module(module, self.root_device)
        self._module = module
        self._plain_parameters = preparation.unsharded_parameters(
            module, data_parallel_mesh(self.device_mesh), self.world_size
        )
        return module

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """Compose ``module``, then point each optimizer, built on its parameters before they were
        sharded, at the sharded ones (by name), and bind it (`setup_optimizer`)."""
        names = {id(param): name for name, param in module.named_parameters()}
        module = self.setup_module(module)
        sharded = dict(module.named_parameters())
        for optimizer in optimizers:
            _repoint(optimizer, names, sharded)
        schedulers = [scheduler] if scheduler is not None else []
        return module, [self._bind(optimizer, schedulers) for optimizer in optimizers], scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Bind ``optimizer`` (its `PlanConfig`, a ``torch.optim.Muon`` converted) and print its plan."""
        return self._bind(optimizer, [])

    def _bind(self, optimizer: Optimizer, schedulers: list[Any]) -> Optimizer:
        if self._module is None:
            raise RuntimeError(
                "Set up the model before its optimizers: model = fabric.setup_module(model), then "
                "fabric.setup_optimizers(optimizer) — or fabric.setup(model, optimizer)."
            )
        bound = preparation.bind_and_describe(
            optimizer, self._module, self.plan_config, schedulers, type(self).__name__, self.num_processes
        )
        self._optimizers.append(bound)
        return bound

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Fabric's backward, then the gradients of parameters that FSDP2 does not shard averaged over
        data parallelism (skipped, like FSDP2's reduce-scatter, under ``fabric.no_backward_sync``)."""
        super().backward(tensor, module, *args, **kwargs)
        if self._plain_parameters and self.world_size > 1 and not self._gradient_sync_blocked:
            preparation.synchronise_unsharded(
                self._plain_parameters,
                data_parallel_mesh(self.device_mesh).get_group(),
                preparation.step_agreement(self._optimizers),
            )

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the norm of every gradient together, across meshes; return that norm."""
        self.precision.unscale_gradients(optimizer)
        parameters = list(self.precision.main_params(optimizer))
        return clip_grad_norm_(
            parameters, float(max_norm), float(norm_type), error_if_nonfinite, agreement_of(optimizer)
        )

    def save_checkpoint(
        self,
        path: PathLike,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save ``state`` (the model, its optimizers, anything else) in Fabric's layout, with every
        owner's matrix state and the record of the optimizers, without risking the checkpoint
        already at ``path``: a save that fails on any rank raises on every rank and leaves it as
        it was (`lightning_canzona.checkpoint.save_atomically`)."""
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options or filter.")
        path = Path(self.broadcast(path))
        _, module = _the_model(state)
        optimizers = [value for value in state.values() if isinstance(value, Optimizer)]
        state = {**state, IDENTITY_KEY: record(optimizers)}
        distributed = self._save_distributed_checkpoint
        write = functools.partial(write_state, state=state, module=module, distributed=distributed)
        save_atomically(path, write, distributed, self.root_device)

    def load_checkpoint(
        self,
        path: PathLike,
        state: dict[str, Any] | nn.Module | Optimizer | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint saved at any mesh into the objects of ``state`` (the model, its
        optimizers; other keys are replaced by the saved values), after checking it on every
        rank: its files (``verify_checkpoints``), its model's shapes, its optimizers. Returns
        what the checkpoint holds besides."""
        if not isinstance(state, dict) or not state:  # a bare module's weights (fabric.load_raw)
            if isinstance(state, nn.Module) and self.verify_checkpoints:
                verify(Path(self.broadcast(path)))
            return super().load_checkpoint(path, state, strict, weights_only)
        path = Path(self.broadcast(path))
        key, module = _the_model(state)
        optimizers = {name: value for name, value in state.items() if isinstance(value, Optimizer)}
        check_before_loading(
            path,
            module,
            list(optimizers.values()),
            strict=strict,
            verify_files=self.verify_checkpoints,
            weights_only=weights_only,
            model_key=key,
            partial_load="pass strict=False to fabric.load",
        )
        if path.is_dir():
            rest = load_distributed(path, module, optimizers, strict, weights_only, model_key=key)
        else:
            rest = load_single_file(path, module, key, optimizers, strict, weights_only)
        rest.pop(IDENTITY_KEY, None)
        for name in [name for name in state if name != key and name not in optimizers]:
            if name in rest:
                state[name] = rest.pop(name)
            elif strict:
                raise KeyError(
                    f"The checkpoint {path} holds no {name!r}; pass strict=False to load without it."
                )
        return rest

    def _compose(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        compose(module, mesh, mixed_precision_policy(self.precision), self.compile_options)
        return module

    def _choose_mesh(self, module: nn.Module | None, composes: bool = True) -> MeshShape:
        """`lightning_canzona.mesh.choose_mesh` with this strategy's sizes and devices."""
        sizes, replicas = self._requested_sizes, self.data_parallel_replicate_size
        return choose_mesh(module, *sizes, self.num_nodes, self.num_processes, composes, replicas)

    def _build_mesh(self, shape: MeshShape, module: nn.Module | None) -> None:
        """Build ``shape``'s mesh for ``module`` (``None``: not set up yet), its replicas decided
        (`preparation.decide_replicas`)."""
        rank_zero_info(shape.describe())
        replicas = self.data_parallel_replicate_size
        shape = preparation.decide_replicas(shape, replicas, self.num_nodes, module, self.root_device)
        self._data_parallel_size = shape.data_parallel_size
        self._tensor_parallel_size = shape.tensor_parallel_size
        self._device_mesh = preparation.build_device_mesh(shape, self.root_device)


class _NoBackwardSync(BackwardSyncControl):
    """``fabric.no_backward_sync``: FSDP2's reduce-scatter and the strategy's averaging of
    unsharded gradients both wait for the micro-batch that steps."""

    def __init__(self, strategy: CanzonaFabricStrategy) -> None:
        self.strategy = strategy

    @contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        self.strategy._gradient_sync_blocked = True
        try:
            with preparation.without_gradient_sync(module):
                yield
        finally:
            self.strategy._gradient_sync_blocked = False


def _the_model(state: dict[str, Any]) -> tuple[str, nn.Module]:
    """The key and the model among ``state``'s values: the one module the strategy set up."""
    modules = [(key, value) for key, value in state.items() if isinstance(value, nn.Module)]
    if len(modules) != 1:
        raise ValueError(
            f"A checkpoint of {CanzonaFabricStrategy.__name__} holds one model, set up by the strategy: "
            f"got {len(modules)} modules in the state ({[key for key, _ in modules]})."
        )
    return modules[0]


def _repoint(optimizer: Optimizer, names: dict[int, str], sharded: dict[str, nn.Parameter]) -> None:
    """Point ``optimizer``'s param groups at the sharded parameters of the same names."""
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} has stepped before fabric.setup: its state belongs to the "
            "parameters before sharding. Create the optimizer after fabric.setup_module(model)."
        )
    for group in optimizer.param_groups:
        try:
            group["params"] = [sharded[names[id(param)]] for param in group["params"]]
        except KeyError:
            raise ValueError(
                f"{type(optimizer).__name__} holds a parameter that is not the model's; fabric.setup "
                "can only point an optimizer of the model's own parameters at their sharded form."
            ) from None
