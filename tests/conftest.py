"""Fixtures that every layer of tests shares.

The tests are by layer: ``unit`` (one process, pure logic and single-device math), ``distributed``
(gloo ranks on the CPU, against the single-process optimizer) and ``integration`` (Trainer, CLI,
notebooks, scripts, checkpoints on disk). Helper modules beside this file (``multiprocess``,
``free_teams``, ``layers``) are importable from all of them.

The fast lane, ``python -m pytest -m "not slow"``, leaves out the tests marked ``slow``, here
(`pytest_collection_modifyitems`): every test of ``integration``, every one that reads the
`examples` fixture, and the slowest distributed ones (`SLOW_DISTRIBUTED`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from lightning import Trainer

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
CONFIGS_DIR = EXAMPLES_DIR / "configs"
CANZONA = shutil.which("canzona") or "canzona"  # the command's script, as pip installed it
#: What tests run as scripts whose subject is not the launch, by name: the script and its
#: arguments (fewer steps than their defaults). They run together in one interpreter (the
#: `examples` fixture).
EXAMPLES = {
    # Written into its folder by the fixture (`headline.headline`): the README's, and with a
    # mistake that fails before any rank starts.
    "headline": (Path("train.py"), []),
    "headline-misspelt": (Path("train.py"), []),
    "fabric-pretrain": (
        EXAMPLES_DIR / "fabric/pretrain.py",
        ["--steps", 2, "--log-every", 1, "--checkpoint", "runs/pretrain/checkpoint"],
    ),
    "fabric-finetune": (EXAMPLES_DIR / "fabric/finetune.py", ["--steps", 4]),
    "transformers-moe": (
        EXAMPLES_DIR / "models/transformers_causal_lm.py",
        ["--model", "qwen3-moe", "--max_steps", 8],
    ),
    "own-model": (EXAMPLES_DIR / "models/own_model.py", ["--max_steps", 8]),
    "fused-weights": (EXAMPLES_DIR / "models/fused_weights.py", ["--max_steps", 8, "--per_head"]),
    # `canzona fit` on the shipped configs (quick: no validation, no progress bar).
    "cli-moe": (
        CANZONA,
        ["fit", "--config", CONFIGS_DIR / "tiny-moe.yaml", "--trainer.max_steps", 2]
        + ["--trainer.limit_val_batches", 0, "--trainer.enable_progress_bar", "false"],
    ),
    "cli-top-level-soap": (
        CANZONA,
        ["fit", "--config", CONFIGS_DIR / "tiny.yaml", "--trainer.devices", 2, "--trainer.max_steps", 2]
        + ["--trainer.limit_val_batches", 0, "--trainer.enable_progress_bar", "false"]
        + ["--optimizer", "lightning_canzona.SOAP", "--optimizer.lr", 0.003]
        # Settings of `strategy: canzona` as users guess them, the plan's by its fields.
        + ["--trainer.strategy.tensor_parallel_size", 1, "--trainer.strategy.plan.policy", "lpt"],
    ),
    # A damaged --ckpt_path (written by the fixture: a saved file cut short), refused there.
    "cli-damaged-ckpt": (CANZONA, ["fit", "--config", CONFIGS_DIR / "tiny.yaml", "--ckpt_path", "cut.ckpt"]),
    # Last: it quietens Lightning's loggers in its process.
    "doctor-quick": (CANZONA, ["doctor", "--quick", "--device", "cpu"]),
}


INTEGRATION_DIR = Path(__file__).resolve().parent / "integration"
#: Distributed tests out of the fast lane, by file and name: each took 2.5 s or more on 2 shared
#: cores (4 ranks on 2 cores, or a Trainer's fit). The fast lane keeps the other distributed tests:
#: the exactness checks on 2 ranks, teams on every mesh, the failures. Named here rather than marked
#: in their files, so that the exactness tests stay as they are.
SLOW_DISTRIBUTED = {
    "test_engine_exactness.py::test_distributed_step_equals_single_process[dp4]",
    "test_engine_exactness.py::test_distributed_step_equals_single_process[dp2xtp2]",
    "test_engine_exactness.py::test_distributed_step_equals_single_process[rep2xdp2]",
    "test_engine_exactness.py::test_distributed_step_equals_single_process[rep2xtp2]",
    "test_team_exactness.py::test_team_updates_equal_single_process[dp2xtp2]",
    "test_qk_clip_exactness.py::test_qk_clip_on_dp4_and_dp2_tp2_equals_one_process_and_bounds_the_logits",
    "test_own_rule.py::test_an_own_rule_runs_exactly_at_dp2_tp2",
    "test_team_prices.py::test_param_groups_that_multiply_in_different_dtypes_are_weighed_by_time",
    "test_composition.py::test_fit_composes_a_mixture_and_bf16_mixed_gathers_in_bf16_and_reduces_in_float32",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks ``slow`` every test of ``integration`` (a Trainer, a CLI, a notebook or a script:
    seconds to minutes each), every test that reads the `examples` fixture (which runs every
    example) wherever it lies, and `SLOW_DISTRIBUTED`."""
    for item in items:
        if (
            item.path.is_relative_to(INTEGRATION_DIR)
            or "examples" in getattr(item, "fixturenames", ())
            or f"{item.path.name}::{item.name}" in SLOW_DISTRIBUTED
        ):
            item.add_marker(pytest.mark.slow)


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
    """Every script of `EXAMPLES` run once for the session, each in a folder of its own, in
    one interpreter (`scripts.run_examples_forked`): by name, its exit code, what it printed
    and its folder; and `scripts.IMPORTED`."""
    from headline import headline
    from scripts import run_examples_forked

    folders = {name: tmp_path_factory.mktemp(name) for name in EXAMPLES}
    (folders["headline"] / "train.py").write_text(headline())
    (folders["headline-misspelt"] / "train.py").write_text(headline(model="Misspelt"))
    saved = folders["cli-damaged-ckpt"] / "saved.ckpt"
    torch.save({"state_dict": {"weight": torch.zeros(4096)}}, saved)
    (folders["cli-damaged-ckpt"] / "cut.ckpt").write_bytes(saved.read_bytes()[:-5000])  # no zip directory
    runs = {name: (script, folders[name], arguments) for name, (script, arguments) in EXAMPLES.items()}
    results = run_examples_forked(runs)
    return {name: (*result, folders.get(name)) for name, result in results.items()}
