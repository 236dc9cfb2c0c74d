"""Fixtures that every layer of tests shares.

The tests are by layer: ``unit`` (one process, pure logic and single-device math), ``distributed``
(gloo ranks on the CPU, against the single-process optimizer) and ``integration`` (Trainer, CLI,
notebooks, scripts, checkpoints on disk). Helper modules beside this file (``multiprocess``,
``free_teams``) are importable from all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from lightning import Trainer

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
#: The examples that tests run, by name: the script and its arguments (fewer steps than their
#: defaults). They run together in one interpreter (the `examples` fixture).
EXAMPLES = {
    "fabric-pretrain": (
        "fabric/pretrain.py",
        ["--steps", 2, "--log-every", 1, "--checkpoint", "runs/pretrain/checkpoint"],
    ),
    "fabric-finetune": ("fabric/finetune.py", ["--steps", 4]),
    "transformers-moe": ("models/transformers_causal_lm.py", ["--model", "qwen3-moe", "--max_steps", 8]),
    "own-model": ("models/own_model.py", ["--max_steps", 8]),
    "fused-weights": ("models/fused_weights.py", ["--max_steps", 8, "--per_head"]),
}


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread during the test, as on each rank: the one-process reference blocks
    every matmul as the ranks do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def quiet_trainer() -> Callable[..., Trainer]:
    """Builds a Trainer on 4 CPU devices that logs, checkpoints and prints nothing of its own;
    keywords add to or override those settings."""

    # Imported here: Lightning, imported before pytest captures logs, stops its loggers from
    # propagating to the root logger, and `caplog` would see none of their records.
    from trainers import quiet_trainer

    return quiet_trainer


@pytest.fixture(scope="session")
def examples(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """Every example of `EXAMPLES` run once for the session, each in a folder of its own, in
    one interpreter (`scripts.run_examples_forked`): by name, its exit code, what it printed
    and its folder."""
    from scripts import run_examples_forked

    folders = {name: tmp_path_factory.mktemp(name) for name in EXAMPLES}
    runs = {
        name: (EXAMPLES_DIR / script, folders[name], arguments)
        for name, (script, arguments) in EXAMPLES.items()
    }
    return {name: (*result, folders[name]) for name, result in run_examples_forked(runs).items()}
