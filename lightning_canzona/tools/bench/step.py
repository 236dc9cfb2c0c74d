"""``canzona bench step``: the optimizer step alone under FSDP2 × TP, canzona against the other
ways to run it, in one run (`run`; `measure` for one preset, `format_table` to print it).

`measure` spawns ``dp × tp`` ranks (CPU processes over gloo, one thread each, or one GPU each over
NCCL), composes a model with its TP plan and ``fully_shard`` per block, gives every parameter a
fixed gradient, and times ``optimizer.step()`` of each of `VARIANTS` in turn, interleaved so that
machine noise hits all alike; a mixture of experts adds `MOE_VARIANTS`, HSDP `HSDP_VARIANTS`, and
a 1-D mesh `DION` where ``import dion`` finds it. `VariantResult` holds what each reports: the
slowest rank's latency, the ranks' CPU time, the balance measured and planned, the peak of the
step's buffers, the bytes sent and the state per rank. docs/benchmarks.md says what each variant
takes away and the figures measured.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

import lightning_canzona as lc
from lightning_canzona.compat import REDISTRIBUTE_LOGGER
from lightning_canzona.config import PlanConfig
from lightning_canzona.launcher import in_fresh_thread
from lightning_canzona.models.qwen3 import Qwen3, tensor_parallel_plan
from lightning_canzona.planning import report
from lightning_canzona.tools.bench.devices import (
    check_devices,
    default_backend,
    rank_device,
    start_method,
    synchronize,
)
from lightning_canzona.tools.tables import table

VARIANTS = (
    "sync",
    "torch.optim.Muon",
    "round_robin",
    "lpt (no overlap)",
    "canzona (whole matrices)",
    "canzona",
    "canzona (teams, measured)",
)
MOE_VARIANTS = ("canzona (locality-blind)", "canzona (call per expert)")
#: Under HSDP: the plan replicated on each replica, and spread over all (``canzona`` chooses).
HSDP_VARIANTS = ("canzona (replicated)", "canzona (spread)")
#: microsoft/dion's distributed Muon: timed where ``import dion`` finds it (a checkout on
#: ``PYTHONPATH``: a comparison, never a dependency) and the mesh is 1-D, which it requires.
DION = "dion.Muon"
#: Each optimizer and its settings in every variant.
OPTIMIZERS: dict[str, tuple[type[lc.MatrixOptimizer], dict]] = {
    "muon": (lc.Muon, {"lr": 0.02, "adamw_lr": 3e-3}),
    # Newton–Schulz iterating on the Gram matrix: a team sums it once per restart, not per step.
    "muon-gram": (lc.Muon, {"lr": 0.02, "adamw_lr": 3e-3, "ns_form": "gram"}),
    # The standard form with its symmetric products by blocks: 5/8 of their FLOPs.
    "muon-symmetric": (lc.Muon, {"lr": 0.02, "adamw_lr": 3e-3, "ns_form": "standard-symmetric"}),
    # Muon's update normalised per output neuron: Muon's step and a little elementwise work.
    "normuon": (lc.NorMuon, {"lr": 0.02, "adamw_lr": 3e-3}),
    "shampoo": (lc.Shampoo, {"lr": 1e-3, "adamw_lr": 3e-3, "start_preconditioning_step": 1}),
    "soap": (lc.SOAP, {"lr": 3e-3, "adamw_lr": 3e-3}),
}


#: Models whose largest matrix is most of the update work (`LargeMatrixModel`), by preset: its
#: ``(out_features, in_features)``. ``wide``'s long side has no Shampoo/SOAP factor at their default
#: ``max_precond_dim``; ``square``'s both sides have one.
LARGE_MATRIX_PRESETS = {"wide": (16384, 256), "square": (1024, 1024)}


class LargeMatrixModel(nn.Module):
    """One large projection and four ``256 × 256`` ones (every matrix column-parallel under TP;
    the benchmark needs no forward): the large one is 94 % (``wide``) of Muon's update FLOPs, and
    97 % (``square``) of Shampoo's."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        block = nn.Module()
        block.large = nn.Linear(in_features, out_features, bias=False)
        block.narrow = nn.ModuleList(nn.Linear(256, 256, bias=False) for _ in range(4))
        self.layers = nn.ModuleList([block])

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        names = ["layers.0.large", *(f"layers.0.narrow.{i}" for i in range(4))]
        return dict.fromkeys(names, ColwiseParallel())


def _model(preset: str) -> tuple[nn.Module, dict[str, ParallelStyle]]:
    if preset in LARGE_MATRIX_PRESETS:
        model = LargeMatrixModel(*LARGE_MATRIX_PRESETS[preset])
        return model, model.tensor_parallel_plan()
    model = Qwen3(preset)
    return model, tensor_parallel_plan(model)


@dataclass(frozen=True)
class VariantResult:
    """Medians over the timed steps."""

    name: str
    step_ms: float
    cpu_ms: float
    busy_max_over_mean: float | None
    state_bytes: list[int]
    plan_max_over_mean: float | None
    peak_bytes: int | None
    model_peak_bytes: int | None
    matrix_bytes_per_rank: float
    over_adamw: float | None
    sent_bytes: int | None
    split_matrices: dict[int, int]


def _matrices_and_others(groups: list[dict]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The parameters of `lightning_canzona.matrix_param_groups`' matrix groups, and of its
    AdamW groups: what the other libraries' optimizers take apart."""
    matrices = [p for g in groups if "algorithm" not in g for _, p in g["params"]]
    others = [p for g in groups if g.get("algorithm") == "adamw" for _, p in g["params"]]
    return matrices, others


class _TorchMuonWithAdamW:
    """``torch.optim.Muon`` for the matrices and ``torch.optim.AdamW`` for the rest."""

    def __init__(self, groups: list[dict]) -> None:
        matrices, others = _matrices_and_others(groups)
        self.optimizers = [torch.optim.Muon(matrices, lr=0.02)]
        if others:
            self.optimizers.append(torch.optim.AdamW(others, lr=3e-3))
        self.state = {k: v for o in self.optimizers for k, v in o.state.items()}
        self.engines: dict = {}

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


class _DionMuon:
    """dion's ``Muon`` for the matrices (its defaults: bf16 Newton–Schulz, compiled) and its
    AdamW for the rest, on the data-parallel mesh."""

    def __init__(self, groups: list[dict], mesh: DeviceMesh) -> None:
        import dion

        matrices, others = _matrices_and_others(groups)
        param_groups = [{"params": matrices}]
        if others:
            param_groups.append({"params": others, "algorithm": "adamw", "lr": 3e-3})
        self.optimizer = dion.Muon(param_groups, distributed_mesh=mesh, lr=0.02)
        self.state = self.optimizer.state
        self.engines: dict = {}

    def step(self) -> None:
        self.optimizer.step()


def _build(
    variant: str,
    groups: list[dict],
    optimizer_name: str = "muon",
    compute_dtype: str | None = None,
    mesh: DeviceMesh | None = None,
) -> object:
    if variant == "torch.optim.Muon":
        return _TorchMuonWithAdamW(groups)
    if variant == DION:
        return _DionMuon(groups, mesh)
    optimizer_class, settings = OPTIMIZERS[optimizer_name]
    if optimizer_class in (lc.Muon, lc.NorMuon):  # bfloat16 by default, as torch.optim.Muon
        settings = {**settings, "compute_dtype": compute_dtype or "bfloat16"}
    if variant in MOE_VARIANTS:
        optimizer = optimizer_class(groups, **settings)
        if variant == "canzona (locality-blind)":
            optimizer.locality = False
        else:
            optimizer.batch_matrices = False
        return optimizer
    if variant.startswith(BUDGET_VARIANT):
        budget = variant.removeprefix(BUDGET_VARIANT).removesuffix(")")
        plan = PlanConfig(memory_budget=None if budget == "None" else parse_budget_text(budget))
        return optimizer_class(groups, **settings, plan=plan)
    policy, overlap = {
        "sync": ("sync", True),
        "round_robin": ("round_robin", True),
        "lpt (no overlap)": ("lpt", False),
        "canzona": ("canzona", True),
        "canzona (whole matrices)": ("canzona", True),
        "canzona (teams, measured)": ("canzona", True),
        **dict.fromkeys(HSDP_VARIANTS, ("canzona", True)),
    }[variant]
    max_team = 1 if variant == "canzona (whole matrices)" else PlanConfig.max_team
    prices = "measure" if variant == "canzona (teams, measured)" else "h100"
    replicas = variant.removeprefix("canzona (").removesuffix(")") if variant in HSDP_VARIANTS else "auto"
    plan = PlanConfig(
        policy=policy, overlap=overlap, max_team=max_team, team_prices=prices, replicas=replicas
    )
    return optimizer_class(groups, **settings, plan=plan)


#: The name of a ``canzona`` variant with another memory budget: ``canzona (memory_budget=0.25)``.
BUDGET_VARIANT = "canzona (memory_budget="


def budget_variant(budget: str) -> str:
    """The variant that runs ``canzona`` with ``PlanConfig(memory_budget=budget)``."""
    return f"{BUDGET_VARIANT}{budget})"


def parse_budget_text(text: str) -> float | str:
    """A ``memory_budget`` given on the command line: a fraction, or a size or ``auto`` as text."""
    try:
        return float(text)
    except ValueError:
        return text


def step_peak(step: Callable[[], object], device: torch.device) -> int:
    """Bytes ``step()`` allocates at its peak beyond what was held before, counted by the allocator
    (every buffer: the rules' temporaries and the backend's too, which the step's own meter does not
    see): on a GPU by its statistics, on a CPU by its events under ``torch.profiler``."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        step()
    events = profiled.profiler.kineto_results.events()  # type: ignore[union-attr]
    running = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        running += nbytes
        peak = max(peak, running)
    return peak


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """The process's standard error (its file descriptor: the profiler's C++ notes) to nowhere."""
    saved = os.dup(2)
    with open(os.devnull, "w") as nowhere:
        os.dup2(nowhere.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _state_bytes(optimizer: object) -> int:
    total = 0
    states = (
        optimizer.state
        if not isinstance(optimizer, _TorchMuonWithAdamW)
        else {k: v for o in optimizer.optimizers for k, v in o.state.items()}
    )
    for state in states.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total


def _adamw_state_bytes(model: nn.Module) -> int:
    """What ``torch.optim.AdamW`` would hold for ``model``'s parameters on this rank: two moments in
    each parameter's dtype, and a float32 step count per parameter."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += 2 * local.numel() * local.element_size() + 4
    return total


def _gather(value: object) -> list:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _worker(
    rank: int,
    world: int,
    port: int,
    dp: int,
    tp: int,
    preset: str,
    steps: int,
    optimizer_name: str,
    queue,
    device_type: str = "cpu",
    backend: str = "gloo",
    warmup: int = 2,
    compute_dtype: str | None = None,
    replicate: int = 1,
    budgets: tuple[str, ...] = (),
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # torch.optim.Muon on DTensors notes on every rank that their norms take two all-reduces.
    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)
    device = rank_device(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # object collectives and barriers use the current device
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),
        device_id=device if device.type == "cuda" else None,
    )
    if replicate > 1:  # HSDP: FSDP2 replicates over "replicate" and shards over "dp"
        shape, names = (replicate, dp // replicate, tp), ("replicate", "dp", "tp")
    else:
        shape, names = (dp, tp), ("dp", "tp")
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    sharding = mesh["replicate", "dp"] if replicate > 1 else mesh["dp"]
    torch.manual_seed(0)
    model, plan = _model(preset)
    model.to(device)
    parallelize_module(model, mesh["tp"], plan)
    for layer in model.layers:
        fully_shard(layer, mesh=sharding)
    fully_shard(model, mesh=sharding)
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        full = (torch.randn(param.shape, generator=generator) * 1e-3).to(device)
        param.grad = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)

    variants = VARIANTS
    if optimizer_name != "muon" or compute_dtype not in (None, "bfloat16"):
        # torch.optim.Muon is Muon's standard form only, in bfloat16
        variants = tuple(v for v in VARIANTS if v != "torch.optim.Muon")
    elif isinstance(model, Qwen3) and model.config.num_experts:  # torch.optim.Muon refuses 3-D stacks
        variants = tuple(v for v in VARIANTS if v != "torch.optim.Muon") + MOE_VARIANTS
    if replicate > 1:
        variants += HSDP_VARIANTS
    variants += tuple(budget_variant(budget) for budget in budgets)
    # dion's Muon takes a 1-D mesh; it runs where torch.optim.Muon does (bf16 Muon, no experts).
    if tp == 1 and replicate == 1 and "torch.optim.Muon" in variants and importlib.util.find_spec("dion"):
        variants += (DION,)
    optimizers = {
        variant: _build(variant, lc.matrix_param_groups(model), optimizer_name, compute_dtype, mesh["dp"])
        for variant in variants
    }
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    busy: dict[str, list[float]] = {v: [] for v in variants}
    for repeat in range(warmup + steps):  # warm-up steps: plans, state, allocator
        for variant, optimizer in optimizers.items():
            synchronize(device)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            optimizer.step()
            synchronize(device)
            elapsed = torch.tensor(time.perf_counter() - start, device=device)
            used = time.process_time() - start_cpu
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if repeat >= warmup:
                times[variant].append(float(elapsed))
                cpu[variant].append(used)
                engines = list(optimizer.engines.values())
                busy[variant].append(sum(e.stats.compute.seconds for e in engines))
    # One more step of each, its peak counted by the allocator: every buffer, the rules' own too.
    peaks = {variant: step_peak(optimizer.step, device) for variant, optimizer in optimizers.items()}
    matrices = [p for g in lc.matrix_param_groups(model) if "algorithm" not in g for _, p in g["params"]]
    matrix_bytes = sum(p.numel() * p.element_size() for p in matrices)
    adamw_bytes = _adamw_state_bytes(model)
    results = []
    for variant, optimizer in optimizers.items():
        rank_busy = _gather(statistics.median(busy[variant]))
        mean_busy = sum(rank_busy) / len(rank_busy)
        engines = list(optimizer.engines.values())
        # The busiest rank's state and step buffers together, against AdamW's state on that rank.
        held = _gather((_state_bytes(optimizer) + peaks[variant]) / adamw_bytes)
        modelled = sum(e.plan.rank_memory()[e.planned.rank].peak for e in engines if e.planned)
        results.append(
            VariantResult(
                name=variant,
                step_ms=1e3 * statistics.median(times[variant]),
                cpu_ms=1e3 * sum(_gather(statistics.median(cpu[variant]))),
                busy_max_over_mean=max(rank_busy) / mean_busy if engines and mean_busy > 0 else None,
                state_bytes=_gather(_state_bytes(optimizer)),
                plan_max_over_mean=report(engines[0].plan).max_over_mean if engines else None,
                peak_bytes=max(_gather(peaks[variant])),
                model_peak_bytes=max(_gather(modelled)) if engines else None,
                matrix_bytes_per_rank=matrix_bytes / world,
                over_adamw=max(held),
                sent_bytes=max(_gather(sum(e.stats.bytes_sent for e in engines))) if engines else None,
                split_matrices=report(engines[0].plan).split_matrices if engines else {},
            )
        )
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def replicate_problem(dp: int, replicate: int) -> str | None:
    """Why ``replicate`` replicas cannot split ``dp`` data-parallel ranks, or ``None``."""
    return (
        None
        if replicate >= 1 and dp % replicate == 0
        else f"--replicate {replicate} does not divide --dp {dp}"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(
    preset: str,
    dp: int = 2,
    tp: int = 2,
    steps: int = 10,
    optimizer: str = "muon",
    device: str = "cpu",
    backend: str | None = None,
    warmup: int = 2,
    compute_dtype: str | None = None,
    replicate: int = 1,
    budgets: tuple[str, ...] = (),
) -> list[VariantResult]:
    """Run the benchmark for one model preset on a ``dp × tp`` mesh of ``device`` ranks (CPU
    processes, or one GPU each) over ``backend`` (``None``: `default_backend`): ``warmup``
    untimed steps, then ``steps`` timed ones, of every variant; Muon's Newton–Schulz in
    ``compute_dtype`` (``None``: bfloat16, as ``torch.optim.Muon``); ``replicate`` > 1: HSDP,
    FSDP2 sharding within each of ``replicate`` replicas of the data-parallel ranks; ``budgets``:
    a ``canzona`` variant more for each ``memory_budget`` (`budget_variant`)."""
    problem = replicate_problem(dp, replicate)
    if problem:
        raise ValueError(problem)
    backend = backend or default_backend(device)
    world = dp * tp
    problem = check_devices(device, backend, world)
    if problem:
        raise ValueError(problem)
    method = start_method(device)
    queue = mp.get_context(method).SimpleQueue()
    args = (world, _free_port(), dp, tp, preset, steps, optimizer, queue)
    args += (device, backend, warmup, compute_dtype, replicate, tuple(budgets))
    in_fresh_thread(mp.start_processes, _worker, args=args, nprocs=world, start_method=method)
    return queue.get()


def format_table(
    preset: str,
    results: list[VariantResult],
    optimizer: str = "muon",
    device: str = "cpu",
    replicate: int = 1,
) -> str:
    """The results, with ratios against ``canzona``."""
    reference = next(r for r in results if r.name == "canzona")
    on = "" if device == "cpu" else f" on {device}"
    on += f" (HSDP: {replicate} replicas)" if replicate > 1 else ""
    rows = []
    for result in results:
        busy = f"{result.busy_max_over_mean:.2f}" if result.busy_max_over_mean else "-"
        planned = f"{result.plan_max_over_mean:.2f}" if result.plan_max_over_mean else "-"
        sent = f"{result.sent_bytes / 2**20:.2f}" if result.sent_bytes is not None else "-"
        peak = f"{result.peak_bytes / 2**20:.2f}" if result.peak_bytes is not None else "-"
        relative = f"{result.peak_bytes / result.matrix_bytes_per_rank:.2f}" if result.peak_bytes else "-"
        model = f"{result.model_peak_bytes / 2**20:.2f}" if result.model_peak_bytes is not None else "-"
        over_adamw = f"{result.over_adamw:.2f}" if result.over_adamw is not None else "-"
        rows.append(
            [
                result.name,
                f"{result.step_ms:.1f}",
                f"{result.step_ms / reference.step_ms:.2f}",
                f"{result.cpu_ms:.1f}",
                f"{result.cpu_ms / reference.cpu_ms:.2f}",
                busy,
                planned,
                peak,
                model,
                relative,
                over_adamw,
                sent,
                " ".join(f"{b / 2**20:.2f}" for b in result.state_bytes),
            ]
        )
    headers = ["variant", "step ms", "÷ canzona", "CPU ms", "÷ canzona", "busy max/mean", "plan max/mean"]
    headers += ["step peak MiB", "model MiB", "÷ matrix bytes/rank", "state + peak ÷ AdamW's", "sent MiB"]
    headers += ["state MiB per rank"]
    lines = [
        f"preset {preset}, {optimizer}: optimizer step{on}, median over ranks' slowest",
        table(headers, rows, margin=1),
    ]
    for result in results:
        if result.split_matrices:
            teams = ", ".join(f"{count} by {size} ranks" for size, count in result.split_matrices.items())
            lines.append(f"{result.name}: matrices computed by teams: {teams}")
    return "\n".join(lines)


def run(
    presets: list[str],
    dp: int,
    tp: int,
    steps: int,
    optimizer: str = "muon",
    echo: Callable[[str], None] = print,
    device: str = "cpu",
    backend: str | None = None,
    warmup: int = 2,
    compute_dtype: str | None = None,
    replicate: int = 1,
    budgets: tuple[str, ...] = (),
) -> None:
    """Measure and print every preset (`measure`)."""
    for preset in presets:
        results = measure(
            preset, dp, tp, steps, optimizer, device, backend, warmup, compute_dtype, replicate, budgets
        )
        echo(format_table(preset, results, optimizer, device, replicate))
