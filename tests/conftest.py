"""Fixtures that every layer of tests shares.

The tests are by layer: ``unit`` (one process, pure logic and single-device math), ``distributed``
(gloo ranks on the CPU, against the single-process optimizer) and ``integration`` (Trainer, CLI,
notebooks, scripts, checkpoints on disk). Helper modules beside this file (``multiprocess``,
``free_teams``) are importable from all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from lightning import Trainer


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
