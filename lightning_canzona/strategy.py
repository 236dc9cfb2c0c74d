"""`CanzonaStrategy`: FSDP2 × tensor parallelism with exact, non-redundant matrix optimizers.

It is Lightning's `ModelParallelStrategy` (a ``(data_parallel, tensor_parallel)`` device mesh,
FSDP2 and DTensor TP, distributed checkpoints) plus:

- **a preflight** in the launching process, before any rank starts (`CanzonaStrategy.preflight`):
  ``"auto"`` mesh sizes the model can take, explicit ones checked against it
  (`lightning_canzona.mesh`), the checkpoint path, and the settings of the optimizers that
  ``configure_optimizers`` builds (`lightning_canzona.optimizer_check`); a failure on the ranks
  printed in full once (`lightning_canzona.launcher.report_failures_briefly`);
- **composition** for LightningModules that do not override ``configure_model``: the module's
  ``tensor_parallel_plan()`` is applied on the TP mesh, then ``fully_shard`` wraps its units
  (blocks, experts, top-level submodules) bottom-up over the DP mesh
  (`lightning_canzona.composition`). A module that overrides ``configure_model`` keeps full
  control and uses ``self.device_mesh``;
- **optimizer binding**: the strategy's plan settings go to every `lightning_canzona` optimizer, and
  a ``torch.optim.Muon`` from ``configure_optimizers`` becomes a `lightning_canzona.Muon` with the
  same settings (its schedulers re-pointed);
- the optimizer plan printed as a table when fitting starts, and telemetry of every optimizer
  step in the logger (`lightning_canzona.telemetry`);
- checkpoints that hold every owner's matrix state, are swapped in crash-atomically, verified
  against what was saved, tied to their optimizer, read without running code from them, and
  refuse another model's clearly (`lightning_canzona.checkpoint`);
- trust across ranks: trainable parameters that FSDP2 does not shard get their gradients averaged
  over data parallelism, plain ones checked equal on every rank (`lightning_canzona.distributed.agreement`),
  and decisions of callbacks (`reduce_boolean_decision`) are agreed over all ranks.

Launching (`lightning_canzona.launcher`), metrics (`lightning_canzona.metrics`), clipping
(`lightning_canzona.precision`) and the optimizer conversion (`lightning_canzona.optim.binding`)
live in modules of their own; this class wires them into Lightning.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_canzona.checkpoint import (
    IDENTITY_KEY,
    check_before_loading,
    check_path_exists,
    distributed_optimizer_state,
    full_optimizer_state,
    load_distributed,
    record,
    save_atomically,
)
from lightning_canzona.compat import (
    PathLike,
    align_compiled_param_names,
    materialize_distributed_module,
    optimizers_to_device,
    set_device_mesh,
)
from lightning_canzona.composition import (
    CompileOptions,
    check_even_batches,
    compile_of_own_composition,
    compile_options,
    compose,
    data_parallel_mesh,
    sampler_kwargs,
)
from lightning_canzona.config import PlanConfig
from lightning_canzona.elastic import nodes_of_launch
from lightning_canzona.launcher import InProcessLauncher, ScriptLauncher, report_failures_briefly
from lightning_canzona.mesh import MeshShape, choose_mesh
from lightning_canzona.metrics import prepare_metrics
from lightning_canzona.optim import MatrixOptimizer
from lightning_canzona.optimizer_check import check_optimizer_settings
from lightning_canzona.precision import check_precision, clip_across_meshes, mixed_precision_policy
from lightning_canzona.preparation import (
    bind_and_describe,
    build_device_mesh,
    check_not_fsdp1,
    decide_replicas,
    share_cpu_cores,
    step_agreement,
    synchronise_unsharded,
    unsharded_parameters,
    without_gradient_sync,
)
from lightning_canzona.telemetry import OptimizerTelemetry


class CanzonaStrategy(ModelParallelStrategy):
    """FSDP2 × DTensor tensor parallelism with exact, non-redundant Muon, Shampoo and SOAP.

    Args:
        data_parallel_size: Devices per data-parallel group; ``"auto"``: the devices that tensor
            parallelism leaves.
        tensor_parallel_size: Devices per tensor-parallel group; ``"auto"``: the largest size
            that divides the devices per node and every size the model's plan splits (attention
            and key/value heads, feed-forward widths: `lightning_canzona.mesh`), 1 (FSDP2 only)
            for a model without a tensor-parallel plan. Explicit sizes are kept as given, and
            checked against the model before any rank starts.
        plan: How each matrix update is planned and run (`lightning_canzona.PlanConfig`:
            ``policy``, ``alpha``, ``cost``, ``micro_group_capacity``, ``max_team``,
            ``team_prices``, ``overlap``), for every lightning_canzona optimizer that gives none
            of its own; one that gives a different one is an error. ``None``: each optimizer's
            own (the defaults unless it sets one).
        save_distributed_checkpoint: Save one shard per rank (``True``) or one full file.
        verify_checkpoints: Before loading a checkpoint, check every file against the sizes and
            CRC-32 checksums recorded when it was saved (a distributed checkpoint's manifest, a
            single file's zip directory): a file cut short or changed is a
            ``CorruptCheckpointError`` naming it on every rank, not wrong weights. Costs one read
            of the checkpoint, shared by the ranks. ``False`` skips that read: a file missing,
            cut short or unreadable is still that error, but bytes changed where they still read
            (inside a tensor) load as they are.
        load_optimizer_state: Load the optimizer's state (and its schedulers') with the weights.
            ``False`` loads the weights and the training progress only and starts the optimizer
            afresh: to resume with another optimizer than the checkpoint's, which is otherwise an
            error naming both.
        process_group_backend: ``nccl``, ``gloo``…; ``None`` picks the device's default.
        timeout: Timeout of collective operations.
        telemetry: Log the optimizer step's latency, compute, communication and imbalance
            (`lightning_canzona.telemetry.OptimizerTelemetry`) at ``log_every_n_steps``.
        start_method: ``popen`` re-runs the script per rank (scripts, CLI, torchrun, SLURM);
            ``fork`` (notebooks) or ``spawn`` start the ranks from this process.
        return_weights: With ``fork`` or ``spawn``: after ``fit``, gather the trained weights whole
            and load them into the launching process's model (as Lightning's ``ddp_notebook``
            does), so a notebook can sample, evaluate or export it. Costs one full copy of the
            weights in host memory on rank 0 and a temporary file; ``False`` for a model too large
            for that (keep its weights with a checkpoint).
        gradient_accumulation: With ``Trainer(accumulate_grad_batches=k)``: ``sharded``
            reduce-scatters every micro-batch's gradients and accumulates shards (as
            Lightning's ``ModelParallelStrategy``: least memory); ``unsharded`` skips the
            reduce-scatter on the micro-batches that do not step, keeping each rank's full
            unsharded gradients until the last one (one reduce-scatter per step, more memory).
        data_parallel_replicate_size: Replicas among the data-parallel devices (HSDP, torchtitan's
            ``data_parallel_replicate``): FSDP2 shards each replica's weights over
            ``data_parallel_size / data_parallel_replicate_size`` devices and all-reduces
            gradients across the replicas; with one replica a node, only that all-reduce and the
            optimizer's exchange cross nodes. 1: FSDP2 shards over every data-parallel device.
            ``"auto"``: a replica a node where one node's devices hold the model (16 bytes a
            parameter in half their memory), else 1 (`lightning_canzona.mesh.auto_replicas`).
        compile: Compile each block of the model the strategy composes (its transformer blocks:
            the units whose class recurs) with ``torch.compile``, after tensor parallelism and
            before FSDP2: ``True`` with its defaults, or a dict of its keywords
            (``{"mode": "max-autotune"}``). Costs compile time at the first step; a module whose
            ``configure_model`` composes itself compiles its blocks there.
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        plan: PlanConfig | None = None,
        save_distributed_checkpoint: bool = True,
        verify_checkpoints: bool = True,
        load_optimizer_state: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        telemetry: bool = True,
        start_method: Literal["popen", "fork", "spawn"] = "popen",
        return_weights: bool = True,
        gradient_accumulation: Literal["sharded", "unsharded"] = "sharded",
        data_parallel_replicate_size: Literal["auto"] | int = 1,
        compile: bool | CompileOptions = False,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.plan_config = PlanConfig.given(plan)
        self.verify_checkpoints = verify_checkpoints
        self.load_optimizer_state = load_optimizer_state
        self.telemetry = telemetry
        if start_method not in ("popen", "fork", "spawn"):
            raise ValueError(f"start_method must be 'popen', 'fork' or 'spawn', got {start_method!r}")
        self.start_method = start_method
        self.return_weights = return_weights
        if gradient_accumulation not in ("sharded", "unsharded"):
            raise ValueError(
                f"gradient_accumulation must be 'sharded' or 'unsharded', got {gradient_accumulation!r}"
            )
        self.gradient_accumulation = gradient_accumulation
        #: ``torch.compile``'s keywords for each block the strategy composes; ``None``: eager.
        self.compile_options = compile_options(compile)
        #: The sizes as given (``"auto"`` or integers); `preflight` resolves them for the model.
        self._requested_sizes = (data_parallel_size, tensor_parallel_size)
        self.data_parallel_replicate_size = data_parallel_replicate_size
        #: The mesh `preflight` chose, until `setup_environment` builds it.
        self._mesh_shape: MeshShape | None = None
        #: Trainable parameters whose gradients the strategy synchronises (`unsharded_parameters`).
        self._plain_parameters: list[tuple[str, torch.nn.Parameter]] = []
        self._gradient_sync_blocked = False

    def _configure_launcher(self) -> None:
        if self.cluster_environment.creates_processes_externally:  # torchrun, SLURM: every rank checks
            report_failures_briefly(self.global_rank)
            self.num_nodes = nodes_of_launch(self.cluster_environment, self.num_processes, self.num_nodes)
        self._check_settings()
        if self.start_method != "popen":
            self._launcher = InProcessLauncher(self, self.start_method, self.preflight, self.return_weights)
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = ScriptLauncher(self, self.preflight)

    def _check_settings(self) -> None:
        """Settings that would fail on every rank fail when the Trainer is built, before any
        process starts: sizes that do not divide the devices, an unsupported precision."""
        self._choose_mesh(None)
        check_precision(self.precision_plugin, type(self).__name__)

    def preflight(self, ckpt_path: PathLike | None = None, fitting: bool = False) -> None:
        """Check what the launching process can know before any rank starts, and choose the mesh.

        The phases: the mesh (`lightning_canzona.mesh.choose_mesh`: ``"auto"`` sizes that the
        model can take, explicit ones checked against its plan and head counts), named in one
        info line; ``ckpt_path`` exists (`lightning_canzona.checkpoint.check_path_exists`); when
        ``fitting``, the optimizers that ``configure_optimizers`` builds on the module as it is
        here accept their settings (`lightning_canzona.optimizer_check`). The launchers run it
        before they start the ranks; `setup_environment` runs it, without the optimizers (the
        ranks are about to build them), where none did (``torchrun``, SLURM).

        Raises:
            ValueError: A mesh the devices or the model cannot take, naming the setting; an
                optimizer's setting out of its range.
            FileNotFoundError: ``ckpt_path`` names a file or folder that does not exist.
            TypeError: An optimizer called with a keyword it does not take.
        """
        module = self.lightning_module
        composes = module is None or not is_overridden("configure_model", module)
        if not composes and self.compile_options is not None:
            composer = f"{type(module).__name__}.configure_model"
            raise compile_of_own_composition("CanzonaStrategy(compile=...)", composer)
        self._mesh_shape = self._choose_mesh(module, composes)
        rank_zero_info(self._mesh_shape.describe())
        check_path_exists(ckpt_path, "ckpt_path")
        if fitting and module is not None:
            check_optimizer_settings(module)

    def _choose_mesh(self, module: pl.LightningModule | None, composes: bool = True) -> MeshShape:
        """`lightning_canzona.mesh.choose_mesh` with this strategy's sizes and devices."""
        sizes, replicas = self._requested_sizes, self.data_parallel_replicate_size
        return choose_mesh(module, *sizes, self.num_nodes, self.num_processes, composes, replicas)

    def setup_environment(self) -> None:
        share_cpu_cores(self.root_device, self.num_processes)
        if self._mesh_shape is None:  # started by torchrun or SLURM: no launcher ran the preflight
            module = self.lightning_module
            self.preflight(module.trainer.ckpt_path if module is not None else None)
        shape, self._mesh_shape = self._mesh_shape, None  # the next run's preflight chooses again
        assert shape is not None
        self._data_parallel_size = shape.data_parallel_size
        self._tensor_parallel_size = shape.tensor_parallel_size
        # ModelParallelStrategy's, but for its mesh: ours may have HSDP's replicate dimension.
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        module, replicas = self.lightning_module, self.data_parallel_replicate_size
        shape = decide_replicas(shape, replicas, self.num_nodes, module, self.root_device)
        self._device_mesh = build_device_mesh(shape, self.root_device)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # configure_model's self.device_mesh
        report_failures_briefly(self.global_rank)  # after init_process_group, which installs its own

    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup, with composition where it would demand configure_model.
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        check_not_fsdp1(self.model, type(self).__name__)
        already_sharded = any(isinstance(p, DTensor) for p in self.lightning_module.parameters())
        if not is_overridden("configure_model", self.lightning_module) and not already_sharded:
            # Once: validate/test reuse it.
            policy = mixed_precision_policy(self.precision_plugin)
            compose(self.lightning_module, self.device_mesh, policy, self.compile_options)
            # The module is now sharded like one whose configure_model did the work.
            set_device_mesh(self.lightning_module, self.device_mesh)
        prepare_metrics(self.lightning_module, data_parallel_mesh(self.device_mesh).get_group())
        materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # Materialized: the parameters are the final objects.
        self._plain_parameters = unsharded_parameters(
            self.lightning_module, data_parallel_mesh(self.device_mesh), self.world_size
        )
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.telemetry and not any(isinstance(c, OptimizerTelemetry) for c in trainer.callbacks):
                trainer.callbacks.append(OptimizerTelemetry())
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data split over the data-parallel ranks (HSDP's replicas and shards together)."""
        return sampler_kwargs(self.device_mesh)

    def process_dataloader(self, dataloader: object) -> object:
        """Refuse a split of ``predict``'s samples that leaves a rank waiting (`check_even_batches`)."""
        assert self.lightning_module is not None
        check_even_batches(dataloader, self.lightning_module.trainer.state.fn.value)
        return super().process_dataloader(dataloader)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Synchronise the gradients of the trainable parameters that FSDP2 does not shard.

        See `lightning_canzona.distributed.agreement`; skipped, like FSDP2's reduce-scatter, on
        micro-batches that accumulate gradients.
        """
        super().post_backward(closure_loss)
        if not self._plain_parameters or self.world_size == 1 or self._gradient_sync_blocked:
            return
        synchronise_unsharded(
            self._plain_parameters,
            data_parallel_mesh(self.device_mesh).get_group(),
            step_agreement(self.optimizers),
        )

    def on_train_end(self) -> None:
        """A failure of the last optimizer step, which no next step will raise, is raised here on
        every rank (`lightning_canzona.distributed.agreement.GradientAgreement.settle`)."""
        super().on_train_end()
        for optimizer in self.optimizers:
            if isinstance(optimizer, MatrixOptimizer):
                optimizer.agreement.settle()

    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        clip_across_meshes(self.precision_plugin)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Under ``gradient_accumulation="unsharded"``, skip gradient synchronisation (FSDP2's
        reduce-scatter, the plain parameters' all-reduce) on micro-batches that do not step."""
        if self.gradient_accumulation == "sharded":
            yield None
            return
        self._gradient_sync_blocked = True
        try:
            with without_gradient_sync(self.model):
                yield None
        finally:
            self._gradient_sync_blocked = False

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the data-parallel group: tensor-parallel ranks hold replicas of one value."""
        if group is None and self._device_mesh is not None:
            group = data_parallel_mesh(self.device_mesh).get_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Whether ``decision`` holds on every rank (``all``) or on any rank, agreed over the world.

        Not through `reduce`, whose data-parallel group would count only part of the ranks.
        """
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return decision
        value = torch.tensor(int(decision), device=self.root_device)
        op = torch.distributed.ReduceOp.MIN if all else torch.distributed.ReduceOp.MAX
        torch.distributed.all_reduce(value, op=op)
        return bool(value)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state; in a single file, with every owner's matrix state in it.

        ``get_optimizer_state_dict(full_state_dict=True)`` gathers sharded (DTensor) state to rank 0
        but keeps only rank 0's plain tensors, so the matrix state of matrices owned elsewhere is
        gathered here explicitly.
        """
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not isinstance(inner, MatrixOptimizer):
            return super().optimizer_state(optimizer)
        assert self.model is not None
        if self._save_distributed_checkpoint:
            return distributed_optimizer_state(self.model, inner)
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        state_dict = full_optimizer_state(self.model, inner)
        if self.global_rank != 0:
            return state_dict
        state_dict = align_compiled_param_names(state_dict, self.model)
        return FullyShardedDataParallel.rekey_optim_state_dict(
            state_dict, OptimStateKeyType.PARAM_ID, self.model
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None
    ) -> None:
        """Save without risking the checkpoint already at ``filepath``.

        The new checkpoint, with the record of its optimizers, is written beside it; a distributed
        one gets its manifest once every rank has written its part; then it is swapped in
        (`lightning_canzona.checkpoint.swap`). A save that fails on any rank raises on every rank
        and leaves ``filepath`` as it was.
        """
        path = Path(self.broadcast(filepath))
        checkpoint[IDENTITY_KEY] = record(self.optimizers)
        write = functools.partial(super().save_checkpoint, checkpoint, storage_options=storage_options)
        save_atomically(path, write, self._save_distributed_checkpoint, self.root_device)

    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint saved at any mesh, after checking it on every rank: its files against
        what was saved (``verify_checkpoints``), its model's shapes and its optimizers against this
        run's. Each problem is the same error on every rank, before any state is touched."""
        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        optimizers = self.optimizers if self.load_optimizer_state else []
        check_before_loading(
            path,
            self.model,
            optimizers,
            strict=strict,
            verify_files=self.verify_checkpoints,
            weights_only=weights_only,
        )
        if self.optimizers and not optimizers:
            rank_zero_info(
                f"lightning_canzona: loading the weights of {path} only (load_optimizer_state=False): "
                "the optimizer and its learning-rate schedulers start afresh."
            )
        if path.is_dir():
            by_key = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(optimizers)}
            loaded = load_distributed(path, self.model, by_key, strict, weights_only)
        else:
            every_optimizer, self.optimizers = self.optimizers, optimizers
            try:
                loaded = super().load_checkpoint(path, weights_only)
            finally:
                self.optimizers = every_optimizer
        if self.optimizers and not optimizers:  # the schedulers restart with the optimizer
            loaded["lr_schedulers"] = [config.scheduler.state_dict() for config in self.lr_scheduler_configs]
        return loaded

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        module, config, per_node = self.lightning_module, self.plan_config, self.num_processes
        self.optimizers = [
            bind_and_describe(optimizer, module, config, schedulers, "CanzonaStrategy", per_node)
            for optimizer in self.optimizers
        ]
