"""Benchmarks: ``canzona bench [train|step|ns|qk-clip]`` (or ``python -m lightning_canzona.bench``).

- ``train`` (the default): end-to-end training iterations, AdamW vs ``ModelParallelStrategy`` +
  ``torch.optim.Muon`` vs canzona, with the Trainer and in a Fabric loop; a table, a JSON file
  and a PNG chart;
- ``step``: the optimizer step alone, canzona's policies vs the alternatives;
- ``ns``: Newton–Schulz forms side by side: time, throughput against plain matmul, accuracy;
- ``qk-clip``: a training iteration with and without QK-clip, and the clip alone.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from lightning_canzona.bench import newton_schulz, qk_clip, step, train
from lightning_canzona.bench.devices import check_devices, default_backend
from lightning_canzona.commands import HelpFormatter, described


def _shape(text: str) -> tuple[int, int]:
    rows, _, cols = text.partition("x")
    return int(rows), int(cols)


def _add_devices(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cpu: CPU processes; cuda: one GPU a rank"
    )
    parser.add_argument(
        "--backend", default=None, help="the process group's backend (default: nccl on cuda, gloo on cpu)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="canzona bench", description=described(__doc__), formatter_class=HelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(commands.add_parser, formatter_class=HelpFormatter)
    training = command(
        "train",
        help="training iterations: AdamW, ModelParallelStrategy + torch.optim.Muon, "
        "canzona (Trainer and Fabric)",
    )
    training.add_argument("--preset", default="tiny", help="Qwen3 preset (see models.qwen3)")
    training.add_argument("--dp", type=int, default=2, help="data-parallel size")
    training.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    training.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    training.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    _add_devices(training)
    training.add_argument("--json", type=Path, default=Path("bench.json"), help="results file")
    training.add_argument("--out", type=Path, default=Path("bench.png"), help="chart file")
    training.add_argument(
        "--compile", action="store_true", help="add canzona with every block compiled (compile=True)"
    )
    ns = command(
        "ns", help="Newton–Schulz forms: time, GFLOP/s against plain matmul, distance from the polar factor"
    )
    shapes = " ".join(f"{rows}x{cols}" for rows, cols in newton_schulz.DEFAULT_SHAPES)
    ns.add_argument(
        "--shapes",
        nargs="+",
        type=_shape,
        default=newton_schulz.DEFAULT_SHAPES,
        metavar="MxN",
        help=f"matrix shapes (default: {shapes})",
    )
    ns.add_argument(
        "--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"], help="dtypes"
    )
    ns.add_argument("--ns-steps", type=int, default=5, help="Newton–Schulz steps")
    ns.add_argument("--repeats", type=int, default=7, help="timed runs of each form (the median is shown)")
    ns.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    ns.add_argument("--device", default="cpu", help="where the forms run: cpu, cuda, cuda:1…")
    steps = command(
        "step", help="optimizer-step latency on dp×tp ranks (CPU or GPU): canzona vs the alternatives"
    )
    _add_devices(steps)
    steps.add_argument(
        "--presets",
        nargs="+",
        default=["tiny", "small"],
        help="Qwen3 presets (see models.qwen3), or wide or square: one large matrix and four small",
    )
    steps.add_argument("--dp", type=int, default=2, help="data-parallel size")
    steps.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    steps.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="HSDP: replicas among the --dp ranks, each sharding over dp / replicate",
    )
    steps.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    steps.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    steps.add_argument(
        "--compute-dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="Muon's Newton–Schulz dtype (default: bfloat16, as torch.optim.Muon; float32 where bf16 "
        "matmuls are slow, as on CPUs without bf16 instructions, and without torch.optim.Muon, "
        "which has bfloat16 only)",
    )
    steps.add_argument(
        "--optimizer",
        choices=sorted(step.OPTIMIZERS),
        default="muon",
        help="the optimizer of every variant (muon-gram, muon-symmetric: Muon with ns_form='gram', "
        "'standard-symmetric')",
    )
    clip = command("qk-clip", help="a training iteration with and without QK-clip (one process)")
    clip.add_argument(
        "--presets", nargs="+", default=["tiny", "small"], help="Qwen3 presets, built without QK-norm"
    )
    clip.add_argument("--seq-lens", nargs="+", type=int, default=[128, 512], help="sequence lengths")
    clip.add_argument("--batch-size", type=int, default=4, help="sequences a batch")
    clip.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights' dtype")
    clip.add_argument("--repeats", type=int, default=5, help="timed iterations (the median is shown)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "train")
    args = parser.parse_args(argv)
    if args.command in ("train", "step"):
        args.backend = args.backend or default_backend(args.device)
        problem = check_devices(args.device, args.backend, args.dp * args.tp)
        if problem:
            parser.error(problem)  # before any rank starts
    if args.command == "step" and (problem := step.replicate_problem(args.dp, args.replicate)):
        parser.error(problem)
    if args.command == "step" and args.compute_dtype and args.optimizer in ("shampoo", "soap"):
        parser.error(f"--compute-dtype is Muon's and NorMuon's: {args.optimizer} computes in float32")

    if args.command == "train":
        train.run(
            args.preset,
            args.dp,
            args.tp,
            args.steps,
            args.warmup,
            args.json,
            args.out,
            device=args.device,
            backend=args.backend,
            compiled=args.compile,
        )
        return
    if args.command == "step":
        step.run(
            args.presets,
            args.dp,
            args.tp,
            args.steps,
            args.optimizer,
            device=args.device,
            backend=args.backend,
            warmup=args.warmup,
            compute_dtype=args.compute_dtype,
            replicate=args.replicate,
        )
        return
    if args.command == "qk-clip":
        rows = qk_clip.measure(
            args.presets, args.seq_lens, args.batch_size, getattr(torch, args.dtype), args.repeats
        )
        print(
            f"A training iteration (forward, backward, Muon step) without and with QK-clip, {args.dtype} "
            f"weights, one process, {torch.get_num_threads()} threads; 'clip ms': the clip alone"
        )
        print(qk_clip.format_table(rows))
        return

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = newton_schulz.measure(
        tuple(args.shapes),
        tuple(getattr(torch, name) for name in args.dtypes),
        args.ns_steps,
        args.repeats,
        args.device,
    )
    print(
        f"Newton–Schulz forms ({args.ns_steps} quintic steps) vs the (a×b)@(b×a) matmul, "
        f"on {args.device}, {torch.get_num_threads()} CPU threads; distances relative to the float64 "
        "polar factor and to the same form in float64"
    )
    print(newton_schulz.format_table(rows))


if __name__ == "__main__":
    main()
