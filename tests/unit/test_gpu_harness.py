"""``CANZONA_TEST_DEVICE=cuda`` runs the distributed tests on GPUs over NCCL, and skips, saying so,
a test whose ranks outnumber the GPUs."""

from __future__ import annotations

import multiprocess
import pytest
import torch


def _never_runs(rank: int, world_size: int) -> None:
    raise AssertionError("no rank may start")


def test_a_test_with_more_ranks_than_gpus_is_skipped_with_the_reason(monkeypatch) -> None:
    monkeypatch.setattr(multiprocess, "DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(pytest.skip.Exception, match="runs 4 ranks, one GPU each, and 2 GPUs are visible"):
        multiprocess.run_on_ranks(4, _never_runs)
