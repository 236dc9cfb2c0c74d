"""``canzona bench``: benchmarks that run canzona and its alternatives side by side, as commands
(never as tests), one function a subcommand; ``canzona bench`` alone runs `train`. The modules
measure (`train`, `step`, `newton_schulz`, `qk_clip`), the functions here check the arguments and
print. docs/benchmarks.md has the figures they measured.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from lightning_canzona.config import PlanConfig
from lightning_canzona.models.qwen3 import PRESETS
from lightning_canzona.tools.bench import newton_schulz, qk_clip, step, train
from lightning_canzona.tools.bench.devices import check_devices, default_backend
from lightning_canzona.tools.command import UsageError, run

Dtype = Literal["bfloat16", "float32"]
Preset = Literal[tuple(PRESETS)]
StepPreset = Literal[(*PRESETS, *step.LARGE_MATRIX_PRESETS)]
StepOptimizer = Literal[tuple(step.OPTIMIZERS)]


def train_command(
    preset: Preset = "tiny",
    dp: int = 2,
    tp: int = 2,
    steps: int = 20,
    warmup: int = 5,
    device: Literal["cpu", "cuda"] = "cpu",
    backend: str | None = None,
    json: Path = Path("bench.json"),
    out: Path = Path("bench.png"),
    compile: bool = False,
) -> None:
    """Training iterations: AdamW, ModelParallelStrategy + torch.optim.Muon, canzona (Trainer and
    Fabric).

    End-to-end iterations with the Trainer and in a Fabric loop, every variant from the same
    weights on the same batches and mesh (`lightning_canzona.tools.bench.train`): a table, a JSON
    file and a PNG chart.

    Args:
        preset: Qwen3 preset
        dp: data-parallel size
        tp: tensor-parallel size
        steps: timed steps per variant
        warmup: untimed steps before them
        device: cpu: CPU processes; cuda: one GPU a rank
        backend: the process group's backend (default: nccl on cuda, gloo on cpu)
        json: results file
        out: chart file
        compile: add canzona with every block compiled (compile=True)
    """
    backend = _ranks_fit(device, backend, dp * tp)
    train.run(preset, dp, tp, steps, warmup, json, out, device=device, backend=backend, compiled=compile)


def step_command(
    presets: tuple[StepPreset, ...] = ("tiny", "small"),
    dp: int = 2,
    tp: int = 2,
    replicate: int = 1,
    steps: int = 10,
    warmup: int = 2,
    device: Literal["cpu", "cuda"] = "cpu",
    backend: str | None = None,
    compute_dtype: Dtype | None = None,
    optimizer: StepOptimizer = "muon",
    budgets: tuple[str, ...] = (),
) -> None:
    """Optimizer-step latency on dp×tp ranks (CPU or GPU): canzona vs the alternatives.

    The optimizer step alone, canzona's policies against the other ways to run it
    (`lightning_canzona.tools.bench.step`).

    Args:
        presets: Qwen3 presets, or wide or square: one large matrix and four small
        dp: data-parallel size
        tp: tensor-parallel size
        replicate: HSDP: replicas among the --dp ranks, each sharding over dp / replicate
        steps: timed steps per variant
        warmup: untimed steps before them
        device: cpu: CPU processes; cuda: one GPU a rank
        backend: the process group's backend (default: nccl on cuda, gloo on cpu)
        compute_dtype: Muon's Newton–Schulz dtype (default: bfloat16, as torch.optim.Muon;
            float32 where bf16 matmuls are slow, as on CPUs without bf16 instructions, and
            without torch.optim.Muon, which has bfloat16 only)
        optimizer: the optimizer of every variant (muon-gram, muon-symmetric: Muon with
            ns_form='gram', 'standard-symmetric')
        budgets: a canzona variant more for each PlanConfig memory_budget (0.25, '512MiB', None)
    """
    backend = _ranks_fit(device, backend, dp * tp)
    problem = step.replicate_problem(dp, replicate)
    if problem:
        raise UsageError(problem)
    if compute_dtype and optimizer in ("shampoo", "soap"):
        raise UsageError(f"--compute-dtype is Muon's and NorMuon's: {optimizer} computes in float32")
    for budget in budgets:
        try:
            PlanConfig(memory_budget=None if budget == "None" else step.parse_budget_text(budget))
        except (TypeError, ValueError) as error:
            raise UsageError(f"--budgets: {error}") from None
    step.run(
        list(presets),
        dp,
        tp,
        steps,
        optimizer,
        device=device,
        backend=backend,
        warmup=warmup,
        compute_dtype=compute_dtype,
        replicate=replicate,
        budgets=budgets,
    )


def ns_command(
    shapes: tuple[str, ...] = tuple(f"{rows}x{cols}" for rows, cols in newton_schulz.DEFAULT_SHAPES),
    dtypes: tuple[Dtype, ...] = ("bfloat16", "float32"),
    ns_steps: int = 5,
    repeats: int = 7,
    threads: int | None = None,
    device: str = "cpu",
) -> None:
    """Newton–Schulz forms: time, GFLOP/s against plain matmul, distance from the polar factor.

    Every form side by side on each shape and dtype (`lightning_canzona.tools.bench.newton_schulz`).

    Args:
        shapes: matrix shapes
        dtypes: dtypes
        ns_steps: Newton–Schulz steps
        repeats: timed runs of each form (the median is shown)
        threads: intra-op threads (default: torch's)
        device: where the forms run: cpu, cuda, cuda:1…
    """
    parsed = []
    for shape in shapes:
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", shape):
            raise UsageError(f"--shapes takes MxN, as 512x2048, got {shape!r}")
        rows, cols = shape.split("x")
        parsed.append((int(rows), int(cols)))
    if threads:
        torch.set_num_threads(threads)
    rows = newton_schulz.measure(
        tuple(parsed), tuple(getattr(torch, name) for name in dtypes), ns_steps, repeats, device
    )
    print(
        f"Newton–Schulz forms ({ns_steps} quintic steps) vs the (a×b)@(b×a) matmul, "
        f"on {device}, {torch.get_num_threads()} CPU threads; distances relative to the float64 "
        "polar factor and to the same form in float64"
    )
    print(newton_schulz.format_table(rows))


def qk_clip_command(
    presets: tuple[Preset, ...] = ("tiny", "small"),
    seq_lens: tuple[int, ...] = (128, 512),
    batch_size: int = 4,
    dtype: Dtype = "bfloat16",
    repeats: int = 5,
) -> None:
    """A training iteration with and without QK-clip (one process), and the clip alone.

    (`lightning_canzona.tools.bench.qk_clip`)

    Args:
        presets: Qwen3 presets, built without QK-norm
        seq_lens: sequence lengths
        batch_size: sequences a batch
        dtype: weights' dtype
        repeats: timed iterations (the median is shown)
    """
    rows = qk_clip.measure(list(presets), list(seq_lens), batch_size, getattr(torch, dtype), repeats)
    print(
        f"A training iteration (forward, backward, Muon step) without and with QK-clip, {dtype} "
        f"weights, one process, {torch.get_num_threads()} threads; 'clip ms': the clip alone"
    )
    print(qk_clip.format_table(rows))


#: The subcommands, in the order ``--help`` lists them.
COMMANDS = {"train": train_command, "ns": ns_command, "step": step_command, "qk-clip": qk_clip_command}


def _ranks_fit(device: str, backend: str | None, ranks: int) -> str:
    """The backend of ``ranks`` ranks on ``device`` (``None``: its default), after checking,
    before any rank starts, that the machine can run them."""
    backend = backend or default_backend(device)
    problem = check_devices(device, backend, ranks)
    if problem:
        raise UsageError(problem)
    return backend


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``canzona bench`` with the arguments after ``bench``: ``train`` when they name no
    subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "train")
    run(
        COMMANDS,
        argv,
        prog="canzona bench",
        description="Benchmarks that run canzona and its alternatives side by side; without a "
        "subcommand, train.",
    )
