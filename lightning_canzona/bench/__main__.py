"""Benchmarks: ``python -m lightning_canzona.bench {ns,step}``."""

from __future__ import annotations

import argparse

import torch

from lightning_canzona.bench import newton_schulz, step


def _shape(text: str) -> tuple[int, int]:
    rows, _, cols = text.partition("x")
    return int(rows), int(cols)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_canzona.bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    ns = commands.add_parser("ns", help="Newton–Schulz GFLOP/s against plain matmul, per shape and dtype")
    ns.add_argument("--shapes", nargs="+", type=_shape, default=newton_schulz.DEFAULT_SHAPES, metavar="MxN")
    ns.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ns.add_argument("--ns-steps", type=int, default=5)
    ns.add_argument("--repeats", type=int, default=7)
    ns.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    steps = commands.add_parser(
        "step", help="optimizer-step latency on dp×tp CPU ranks: canzona vs the alternatives"
    )
    steps.add_argument(
        "--presets", nargs="+", default=["tiny", "small"], help="Qwen3 presets (see models.qwen3)"
    )
    steps.add_argument("--dp", type=int, default=2)
    steps.add_argument("--tp", type=int, default=2)
    steps.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    args = parser.parse_args(argv)

    if args.command == "step":
        step.run(args.presets, args.dp, args.tp, args.steps)
        return

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = newton_schulz.measure(
        tuple(args.shapes), tuple(getattr(torch, name) for name in args.dtypes), args.ns_steps, args.repeats
    )
    print(f"Newton–Schulz ({args.ns_steps} steps) vs (a×b)@(b×a) matmul, {torch.get_num_threads()} threads")
    print(newton_schulz.format_table(rows))


if __name__ == "__main__":
    main()
