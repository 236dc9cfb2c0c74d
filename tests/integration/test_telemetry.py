"""Runtime telemetry: the optimizer step's costs reach the Lightning logger during fit."""

from __future__ import annotations

import csv
from collections import Counter

import pytest
import torch
from lightning import Trainer
from lightning.pytorch.loggers import CSVLogger

import lightning_canzona as lc
from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.models import CausalLanguageModel, Qwen3
from lightning_canzona.optim import PRESETS, matrix_param_groups
from lightning_canzona.planning import PlanSettings, build_plan, describe
from lightning_canzona.rules import MuonRule
from lightning_canzona.rules.muon import resolve_dtype
from lightning_canzona.telemetry import (
    COMPUTE_MAX_MS,
    COMPUTE_MS,
    IMBALANCE,
    MATRICES,
    SENT_MIB,
    STEP_MS,
    WAIT_MS,
)
from lightning_canzona.tools.simulation.traffic import traffic


def test_step_costs_are_logged_and_bytes_match_the_planners_traffic_model(tmp_path) -> None:
    trainer = Trainer(
        accelerator="cpu",
        devices=4,
        strategy=lc.CanzonaStrategy(data_parallel_size=2, tensor_parallel_size=2, start_method="fork"),
        max_steps=4,
        log_every_n_steps=2,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(CausalLanguageModel(preset="tiny"), datamodule=ByteTextDataModule(seq_len=32, batch_size=4))
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as file:
        logged = [row for row in csv.DictReader(file) if row.get(STEP_MS)]
    assert [int(row["step"]) for row in logged] == [1, 3]  # every second step (0-based)

    with torch.device("meta"):
        named = [(n, p.shape) for n, p in matrix_param_groups(Qwen3("tiny"))[0]["params"]]
    plan = build_plan(describe(named, MuonRule(PRESETS["quintic"])), 2, 2, PlanSettings())
    # Every tiny matrix splits evenly over the 4 ranks, as the model assumes; Muon exchanges its
    # compute dtype ("auto": bf16 where the CPU multiplies it, float32 elsewhere).
    element_bytes = resolve_dtype("auto", torch.device("cpu")).itemsize
    expected_mib = sum(traffic(plan, element_bytes=element_bytes).rank_sent) / 2**20
    for row in logged:
        values = {
            name: float(row[name])
            for name in (STEP_MS, IMBALANCE, COMPUTE_MS, COMPUTE_MAX_MS, WAIT_MS, SENT_MIB, MATRICES)
        }
        assert values[SENT_MIB] == pytest.approx(expected_mib, rel=1e-6)
        assert values[STEP_MS] >= values[COMPUTE_MAX_MS] >= values[COMPUTE_MS] > 0
        assert values[IMBALANCE] == pytest.approx(values[COMPUTE_MAX_MS] / values[COMPUTE_MS], rel=1e-5)
        assert values[IMBALANCE] >= 1.0
        assert values[STEP_MS] >= values[WAIT_MS]  # the blocked time lies within the step
        # The busiest rank computes as many matrices per step as the plan gives it.
        assert values[MATRICES] == max(Counter(plan.owners).values())
