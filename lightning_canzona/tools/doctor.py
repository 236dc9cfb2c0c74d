"""``canzona doctor``: check this machine for lightning_canzona, one line per check (`doctor`).

Each check is a function of the `Settings` (the device, and whether to keep to the quick sizes)
that returns a `Result`: `ENVIRONMENT` describes the machine, `CHECKS` runs on its device. What
the tests check too comes from `lightning_canzona.tools.checks`. docs/doctor.md says what each
line means, and how the bounds were set from measured distances.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_canzona.rules.muon import resolve_dtype
from lightning_canzona.rules.newton_schulz import FORMS
from lightning_canzona.tools.checks import (
    HOST_SYNCS_PER_STEP,
    RESUME_TOLERANCE,
    HostSyncs,
    RecordLosses,
    take_steps,
)
from lightning_canzona.tools.command import UsageError, run

#: A check's verdict: INFO describes the machine; PASS and FAIL are the checks'.
Verdict = Literal["PASS", "FAIL", "INFO"]

#: The largest relative distance of Newton–Schulz in each dtype from the same iteration in
#: float64 (rounding alone): a few times what rounding gives, far below TF32 in a float32
#: iteration or a wrong kernel (docs/doctor.md, "How the bounds were set").
NS_ROUNDING_BOUNDS = {torch.float32: 5e-5, torch.bfloat16: 0.1}
#: The largest relative distance of Shampoo's and SOAP's weight updates (float32 on the device)
#: from their float64 references (`lightning_canzona.rules.references`), over steps with
#: decompositions: above what rounding gives, far below TF32 in these products. SOAP is checked
#: on small square matrices only, where rounding cannot turn its bases (docs/doctor.md).
KRONECKER_BOUND = 3e-4


@dataclass(frozen=True)
class Settings:
    """What every check gets: the device it checks and whether to keep to the quick sizes."""

    device: torch.device
    quick: bool

    def pick(self, quick: Any, cpu: Any, gpu: Any) -> Any:
        """The sizes of a check: ``quick``'s with ``--quick``, else ``cpu``'s or ``gpu``'s (larger:
        the kernels that real shapes run) as the device is."""
        return quick if self.quick else gpu if self.device.type == "cuda" else cpu


@dataclass(frozen=True)
class Result:
    """A check's verdict and its figure (one line of text)."""

    verdict: Verdict
    figure: str

    @classmethod
    def check(cls, passed: bool, figure: str) -> Result:
        """PASS or FAIL, as ``passed`` says."""
        return cls("PASS" if passed else "FAIL", figure)


Check = Callable[[Settings], Result]


# -- the environment -------------------------------------------------------------------------


def versions(settings: Settings) -> Result:
    """Python, torch with its CUDA and NCCL, Lightning and lightning_canzona."""
    import lightning

    import lightning_canzona

    cuda = torch.version.cuda or "none"
    nccl = "none"
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return Result(
        "INFO",
        f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {cuda}, NCCL {nccl}), "
        f"Lightning {lightning.__version__}, lightning_canzona {lightning_canzona.__version__}",
    )


def precision_switches(settings: Settings) -> Result:
    """The switches that let float32 matmuls run in TF32 and bf16 sums round: the model's
    forward and backward follow them; Shampoo, SOAP and float32 Muon compute in IEEE float32
    whatever they say (`lightning_canzona.rules.base`). And the dtype of Muon's default
    ``compute_dtype="auto"`` on the device."""
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through torch's per-backend API in a way the legacy one cannot say
        precision = f"per backend (cuda {torch.backends.cuda.matmul.fp32_precision})"
    matmul = torch.backends.cuda.matmul
    return Result(
        "INFO",
        f"float32 matmul precision {precision}, TF32 matmul {_on(matmul.allow_tf32)}, cuDNN TF32 "
        f"{_on(torch.backends.cudnn.allow_tf32)}, bf16 reduced-precision reduction "
        f"{_on(matmul.allow_bf16_reduced_precision_reduction)}, Muon's compute_dtype 'auto' "
        f"{str(resolve_dtype('auto', settings.device)).removeprefix('torch.')}",
    )


def devices(settings: Settings) -> Result:
    """The devices the checks run on: the GPUs (name, memory, count) or the CPU (cores, vector
    instructions, bf16 matrix instructions); FAIL where the chosen device cannot be used."""
    device = settings.device
    if device.type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return Result(
            "INFO",
            f"cpu: {cores} cores, {torch.get_num_threads()} torch threads, "
            f"{torch.backends.cpu.get_cpu_capability()}, bf16 matrix instructions: {_bf16_instructions()}",
        )
    if device.type != "cuda":
        return Result("FAIL", f"--device {device}: canzona doctor checks cpu and cuda devices")
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        return Result(
            "FAIL", f"--device {device}: torch sees no CUDA device (torch {torch.__version__} is {built})"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return Result("FAIL", f"--device {device}: torch sees {count} CUDA device(s)")
    described = {}
    for index in _gpu_indices(settings):
        properties = torch.cuda.get_device_properties(index)
        name = (
            f"{properties.name} ({properties.total_memory / 2**30:.1f} GiB, "
            f"compute capability {properties.major}.{properties.minor})"
        )
        described[name] = described.get(name, 0) + 1
    return Result("INFO", "cuda: " + ", ".join(f"{count} × {name}" for name, count in described.items()))


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _bf16_instructions() -> str:
    """Whether the CPU has bf16 matrix instructions (x86's AVX512-BF16 or AMX-BF16, Arm's BF16),
    from ``/proc/cpuinfo``: "unknown" where that cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    found = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return f"yes ({', '.join(found)})" if found else "no"


def _gpu_indices(settings: Settings) -> list[int]:
    """The GPUs of the Trainer run (one rank each): the one chosen, or every one visible."""
    if settings.device.index is not None:
        return [settings.device.index]
    return list(range(torch.cuda.device_count()))


# -- the checks on the device --------------------------------------------------------------------


def newton_schulz(form: str, dtype: torch.dtype, settings: Settings) -> Result:
    """Newton–Schulz in ``form`` and ``dtype`` on the device, against the same iteration in
    float64 (rounding: `NS_ROUNDING_BOUNDS`) and against the float64 polar factor (the quintic
    schedule's approximation, reported), on a wide and a tall matrix."""
    distances = []
    shapes = settings.pick(((64, 160), (160, 64)), ((256, 1024), (1024, 256)), ((1024, 4096), (4096, 1024)))
    for shape in shapes:
        references = _ns_references(shape)
        distances.append(references.accuracy(references.run(form, dtype, settings.device)(), form))
    rounding = max(distance.from_float64 for distance in distances)
    polar = max(distance.from_polar for distance in distances)
    bound = NS_ROUNDING_BOUNDS[dtype]
    return Result.check(
        rounding <= bound,
        f"{_sizes(shapes)}: from float64 {rounding:.1e} (bound {bound:.0e}), "
        f"from the polar factor {polar:.2f}",
    )


def _sizes(shapes: tuple[tuple[int, int], ...]) -> str:
    return " and ".join(f"{rows}×{cols}" for rows, cols in shapes)


@functools.cache
def _ns_references(shape: tuple[int, int]) -> Any:
    from lightning_canzona.tools.bench.newton_schulz import References

    return References(shape)


def compiled(settings: Settings) -> Result:
    """Muon's Newton–Schulz compiled (``compile=True``: `lightning_canzona.rules.newton_schulz`)
    against eager, in the dtype ``compute_dtype="auto"`` takes on the device: the same bits, and
    what compiling costs at the first call and gains after (median of the later calls). The
    standard form; without ``--quick`` also the Gram form with its products by blocks (between
    them every piece of the four forms), whose graph takes a CPU longest to compile."""
    from lightning_canzona.rules.newton_schulz import PRESETS, newton_schulz
    from lightning_canzona.tools.bench.devices import synchronize

    shape = settings.pick((64, 160), (512, 1536), (4096, 12288))
    dtype = resolve_dtype("auto", settings.device)
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(settings.device)

    def timed(form: str, compile: bool) -> tuple[torch.Tensor, float, float]:
        """The result, the first call's seconds and the later calls' median."""
        seconds = []
        for _ in range(settings.pick(5, 10, 10)):
            synchronize(settings.device)
            start = time.perf_counter()
            result = newton_schulz(matrix, PRESETS["quintic"], 5, 1e-7, dtype, form, compile)
            synchronize(settings.device)
            seconds.append(time.perf_counter() - start)
        return result, seconds[0], statistics.median(seconds[1:])

    figures, differences = [], []
    for form in ("standard",) if settings.quick else ("standard", "gram-symmetric"):
        eager, _, eager_seconds = timed(form, False)
        result, first, compiled_seconds = timed(form, True)
        figures.append(
            f"{form}: first call {first:.1f} s, then {compiled_seconds * 1e3:.2f} ms against eager "
            f"{eager_seconds * 1e3:.2f} ms ({compiled_seconds / eager_seconds:.2f}×)"
        )
        if not torch.equal(result, eager):
            difference = float((result.float() - eager.float()).abs().max())
            differences.append(f"{form} differs from eager by up to {difference:.1e}")
    figure = f"{shape[0]}×{shape[1]} {str(dtype).removeprefix('torch.')}, " + "; ".join(figures)
    if differences:
        return Result("FAIL", f"{figure}; " + "; ".join(differences))
    return Result("PASS", f"{figure}; bit for bit eager's")


def muon(settings: Settings) -> Result:
    """``lightning_canzona.Muon`` against ``torch.optim.Muon`` on the device, a few steps on a
    wide and a tall matrix with their defaults (bf16 Newton–Schulz): the same operations in the
    same order, so the same bits (``tests/unit/test_muon.py``)."""
    import lightning_canzona as lc

    shapes = settings.pick(((64, 96), (96, 64)), ((256, 768), (768, 256)), ((1024, 3072), (3072, 1024)))
    steps = 3
    differences = []
    for shape in shapes:
        generator = torch.Generator().manual_seed(0)
        initial = torch.randn(shape, generator=generator)
        grads = [torch.randn(shape, generator=generator) for _ in range(steps)]
        ours, _ = take_steps(lc.Muon, initial, grads, settings.device, lr=0.02, compute_dtype="bfloat16")
        theirs, _ = take_steps(torch.optim.Muon, initial, grads, settings.device, lr=0.02)
        differences.append(float((ours - theirs).abs().max()))
    sizes = _sizes(shapes)
    if not any(differences):
        return Result("PASS", f"{sizes}, {steps} steps: bit for bit equal")
    return Result("FAIL", f"{sizes}, {steps} steps: weights differ by up to {max(differences):.1e}")


def shampoo(settings: Settings) -> Result:
    """`kronecker` for Shampoo: roots at steps 2, 4, 6… (factors of full rank by then)."""
    from lightning_canzona import Shampoo
    from lightning_canzona.rules.references import reference_shampoo

    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, epsilon=1e-4)
    schedule = dict(precondition_frequency=2, start_preconditioning_step=2)

    def reference(initial: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
        return reference_shampoo(initial, grads, start=2, frequency=2, max_dim=8192, **hyper)

    shapes = settings.pick(((24, 40), (40, 24)), ((128, 256), (256, 128)), ((512, 1024), (1024, 512)))
    return kronecker(Shampoo, {**hyper, **schedule}, reference, shapes, settings)


def soap(settings: Settings) -> Result:
    """`kronecker` for SOAP: bases at the first step, refreshed every third after, on small square
    matrices at every size of run (`KRONECKER_BOUND` says why)."""
    from lightning_canzona import SOAP
    from lightning_canzona.rules.references import reference_soap

    hyper = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

    def reference(initial: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
        return reference_soap(initial, grads, frequency=3, **hyper)[0]

    return kronecker(SOAP, {**hyper, "precondition_frequency": 3}, reference, ((24, 24), (32, 32)), settings)


def kronecker(
    optimizer_class: Callable[..., torch.optim.Optimizer],
    hyper: dict[str, Any],
    reference: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor],
    shapes: tuple[tuple[int, int], ...],
    settings: Settings,
) -> Result:
    """Shampoo or SOAP on the device against its float64 reference on the CPU, over steps that
    include decompositions, with float32 matmuls allowed in TF32 as Lightning recommends on
    GPUs (the rules compute in IEEE float32 whatever the switch says): the relative distance of
    the weights' change (bound `KRONECKER_BOUND`), no decomposition failure; float64 retries
    of failed float32 decompositions are reported."""
    from lightning_canzona.rules.base import counting_retries

    steps = settings.pick(7, 10, 10)
    distances, failures, retried = [], 0, 0
    for seed, shape in enumerate(shapes):
        generator = torch.Generator().manual_seed(seed)
        initial = torch.randn(shape, dtype=torch.float64, generator=generator)
        grads = [torch.randn(shape, dtype=torch.float64, generator=generator) for _ in range(steps)]
        with _tf32_allowed(), counting_retries() as retries:
            weight, state = take_steps(
                optimizer_class, initial.float(), [g.float() for g in grads], settings.device, **hyper
            )
        failures += int(state["decomposition_failures"])
        retried += retries()
        expected = reference(initial, grads) - initial
        distances.append(
            float(torch.linalg.norm(weight.double() - initial - expected) / torch.linalg.norm(expected))
        )
    sizes = _sizes(shapes)
    distance = max(distances)
    return Result.check(
        distance <= KRONECKER_BOUND and not failures,
        f"{sizes}, {steps} steps: from float64 {distance:.1e} (bound {KRONECKER_BOUND:.0e}), "
        f"{failures} decomposition failures, {retried} retried in float64",
    )


@contextlib.contextmanager
def _tf32_allowed() -> Iterator[None]:
    """Float32 matmuls allowed in TF32 inside (``set_float32_matmul_precision("high")``), the
    switch as it was after."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


#: How far the plan's model of a step's peak memory may be from the allocator's count (`host_syncs`).
MODEL_TOLERANCE = 0.25


def host_syncs(settings: Settings) -> Result:
    """A Muon step of a small model sharded by FSDP2 over the device's ranks (one a GPU, NCCL;
    2 CPU ranks, gloo), after two that built its plan and state: how often each rank reads a
    value of the device on the host in it (`lightning_canzona.tools.checks.HostSyncs`), at most
    `HOST_SYNCS_PER_STEP`; and one more step's peak memory, by the allocator against the plan's
    model, within `MODEL_TOLERANCE` (the step's own meter beside them). The ranks fork as
    `trainer`'s do."""
    import torch.multiprocessing as mp

    from lightning_canzona.launcher import in_fresh_thread

    gpus = _gpu_indices(settings) if settings.device.type == "cuda" else []
    ranks = len(gpus) or 2
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    queue = mp.get_context(method).SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="canzona-doctor-") as folder:
        rendezvous = f"file://{folder}/rendezvous"
        in_fresh_thread(
            mp.start_processes,
            _count_host_syncs,
            args=(ranks, rendezvous, gpus, queue),
            nprocs=ranks,
            start_method=method,
        )
        where, memory = queue.get()
    most = max(where, key=len)
    figure = f"{ranks} ranks (FSDP2), a Muon step: at most {len(most)} (limit {HOST_SYNCS_PER_STEP})"
    allocated, metered, modelled = max(memory)
    off = abs(allocated - modelled) / max(allocated, 1)
    figure += (
        f"; its peak {allocated / 2**10:.0f} KiB by the allocator, {modelled / 2**10:.0f} KiB modelled "
        f"({off:.0%} off, limit {MODEL_TOLERANCE:.0%}), {metered / 2**10:.0f} KiB metered"
    )
    if len(most) <= HOST_SYNCS_PER_STEP and off <= MODEL_TOLERANCE:
        return Result("PASS", figure)
    return Result("FAIL", f"{figure}: {'; '.join(most)}")


def _count_host_syncs(rank: int, ranks: int, rendezvous: str, gpus: list[int], queue: Any) -> None:
    """`host_syncs` on one rank; rank 0 puts every rank's syncs (where each was made) in ``queue``."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lightning_canzona as lc
    from lightning_canzona.tools.bench.step import step_peak

    torch.set_num_threads(1)
    device = torch.device("cuda", gpus[rank]) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    backend = "nccl" if gpus else "gloo"
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=ranks)
    mesh = init_device_mesh(device.type, (ranks,))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = lc.Muon(lc.matrix_param_groups(model), lr=0.02)
    for _ in range(3):
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        with HostSyncs() as syncs:
            optimizer.step()
    # One more step, its peak counted by the allocator, the plan's model and the step's meter.
    (engine,) = optimizer.engines.values()
    allocated = step_peak(optimizer.step, device)
    memory = (allocated, engine.stats.peak_buffer_bytes, engine.plan.rank_memory()[engine.planned.rank].peak)
    optimizer.agreement.settle()  # a failure of the last step, which no step follows, raises here
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, (syncs.where, memory))
    if rank == 0:
        queue.put(([where for where, _ in gathered], [figures for _, figures in gathered]))
    dist.barrier()
    dist.destroy_process_group()


def trainer(settings: Settings) -> Result:
    """A short Trainer run of the bundled tiny model under ``CanzonaStrategy`` with SOAP (matrix
    state on each matrix's owner: the hard case) on the device's ranks (one a GPU, NCCL; 2 CPU
    ranks on gloo), saving a distributed checkpoint midway; then a run resumed from it: its
    losses must equal the uninterrupted run's (`RESUME_TOLERANCE`). The runs fork their ranks:
    from this process where it has not used CUDA, else from a fresh process (a process that has
    used CUDA cannot fork; a fresh one costs an interpreter and its imports)."""
    steps = settings.pick(4, 6, 6)
    with tempfile.TemporaryDirectory(prefix="canzona-doctor-") as folder:
        if torch.cuda.is_initialized():
            process = multiprocessing.get_context("spawn").Process(
                target=_two_runs, args=(Path(folder), settings, steps), name="canzona-doctor-trainer"
            )
            process.start()
            process.join(timeout=600)
            if process.exitcode is None:
                process.kill()
                process.join()
                return Result("FAIL", "the runs did not end in 600 s")
            if process.exitcode:
                return Result("FAIL", f"the runs failed (exit code {process.exitcode}): their error is above")
        else:
            _two_runs(Path(folder), settings, steps)
        uninterrupted = torch.load(Path(folder) / "uninterrupted.pt")
        resumed = torch.load(Path(folder) / "resumed.pt")
    ranks = len(_gpu_indices(settings)) if settings.device.type == "cuda" else 2
    midway = steps // 2
    if len(resumed) != steps - midway:
        return Result("FAIL", f"the resumed run took {len(resumed)} steps, not {steps - midway}")
    difference = max(abs(a - b) for a, b in zip(resumed, uninterrupted[midway:]))
    return Result.check(
        difference <= RESUME_TOLERANCE,
        f"{ranks} ranks, {steps} steps, resumed at step {midway}: losses "
        f"{uninterrupted[0]:.3f} → {uninterrupted[-1]:.3f}, resumed ones differ by {difference:.0e} "
        f"(tolerance {RESUME_TOLERANCE:.0e})",
    )


def _two_runs(folder: Path, settings: Settings, steps: int) -> None:
    """The uninterrupted run, with a checkpoint midway, then the run resumed from it; each saves
    its losses to ``folder`` (``uninterrupted.pt``, ``resumed.pt``)."""
    from lightning import Callback, Trainer

    import lightning_canzona as lc
    from lightning_canzona.data import ByteTextDataModule
    from lightning_canzona.models import CausalLanguageModel

    for name in ("lightning.pytorch", "lightning.fabric"):  # no banners: the ranks are forked
        logging.getLogger(name).setLevel(logging.WARNING)

    midway = steps // 2
    checkpoint = folder / f"step={midway}.ckpt"

    class SaveMidway(Callback):
        """Saves ``checkpoint`` after step ``midway``, as ``ModelCheckpoint`` would, but with no
        state of its own in it, which the resumed run would need (Lightning warns then)."""

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
            if trainer.global_step == midway:  # never in the resumed run: it starts after it
                trainer.save_checkpoint(checkpoint)

    for name, resume in (("uninterrupted", None), ("resumed", checkpoint)):
        torch.manual_seed(0)
        cuda = settings.device.type == "cuda"
        run = Trainer(
            accelerator="cuda" if cuda else "cpu",
            devices=_gpu_indices(settings) if cuda else 2,
            strategy=lc.CanzonaStrategy(start_method="fork", timeout=timedelta(seconds=120)),
            max_steps=steps,
            # The checkpoint midway is in the first epoch, the second begins after it: the data
            # module's loader resumes where it stopped.
            limit_train_batches=midway + 1,
            limit_val_batches=0,
            logger=False,
            default_root_dir=folder,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[RecordLosses(folder / f"{name}.pt"), SaveMidway()],
        )
        module = CausalLanguageModel(
            preset="tiny",
            optimizer=functools.partial(lc.SOAP, lr=3e-3, precondition_frequency=2),
            warmup_steps=1,
        )
        run.fit(module, datamodule=ByteTextDataModule(seq_len=32, batch_size=4), ckpt_path=resume)


# -- the registry and the command ------------------------------------------------------------

#: What the machine is: always INFO, unless the chosen device cannot be used (FAIL).
ENVIRONMENT: dict[str, Check] = {
    "versions": versions,
    "precision switches": precision_switches,
    "devices": devices,
}
#: The checks on the device, in order: name → check.
CHECKS: dict[str, Check] = {
    **{
        f"Newton–Schulz {form} {str(dtype).removeprefix('torch.')}": functools.partial(
            newton_schulz, form, dtype
        )
        for form in FORMS
        for dtype in (torch.float32, torch.bfloat16)
    },
    "compiled Newton–Schulz": compiled,
    "Muon = torch.optim.Muon": muon,
    "Shampoo vs float64": shampoo,
    "SOAP vs float64": soap,
    "host syncs of a step": host_syncs,
    "Trainer checkpoint resume": trainer,
}


def run_checks(checks: dict[str, Check], settings: Settings, width: int = 0) -> bool:
    """Run ``checks`` in order, printing one line each: verdict, name (padded to ``width``),
    seconds, figure. A check that raises fails with its error. Returns whether none failed."""
    passed = True
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            result = check(settings)
        except Exception as error:  # noqa: BLE001 — a check that raises is a failed check
            result = Result("FAIL", f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}")
        seconds = time.perf_counter() - start
        print(f"{result.verdict}  {name:<{width}}  {seconds:6.1f} s  {result.figure}", flush=True)
        passed = passed and result.verdict != "FAIL"
    return passed


def doctor(device: str | None = None, quick: bool = False) -> None:
    """Check this machine for lightning_canzona, one line per check.

    First what it runs on (INFO: versions, precision switches, devices), then checks on the
    device (PASS or FAIL), each with its figure and the seconds it took: Newton–Schulz against
    float64, compiled against eager, Muon against torch.optim.Muon, Shampoo and SOAP against
    float64, the host syncs of a distributed step, and a Trainer run resumed from a checkpoint.
    The exit status is 1 when a check fails. A FAIL line names what differs; docs/doctor.md says
    what each line checks and what to do.

    Example::

        canzona doctor            # on the GPUs when torch sees any, else on the CPU
        canzona doctor --quick --device cpu

    Args:
        device: where the checks run: cpu, cuda (every visible GPU), cuda:1… (default: cuda when
            torch sees a GPU, else cpu)
        quick: small sizes and few steps: under a minute on a CPU

    Raises:
        UsageError: ``device`` is not a device torch knows.
    """
    try:
        chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise UsageError(f"--device {device}: {error}") from None
    settings = Settings(chosen, quick)
    start = time.perf_counter()
    print(f"canzona doctor{' --quick' if quick else ''} on {settings.device}", flush=True)
    width = max(map(len, [*ENVIRONMENT, *CHECKS]))
    healthy = run_checks(ENVIRONMENT, settings, width) and run_checks(CHECKS, settings, width)
    print(f"{'All checks passed' if healthy else 'A check failed'} in {time.perf_counter() - start:.0f} s")
    if not healthy:
        raise SystemExit(1)


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``canzona doctor`` with the arguments after ``doctor``."""
    run(doctor, sys.argv[1:] if argv is None else argv, prog="canzona doctor")


if __name__ == "__main__":
    main()
