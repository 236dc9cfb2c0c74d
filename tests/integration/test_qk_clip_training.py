"""QK-clip as users turn it on: a LightningCLI YAML, ``Trainer``, ranks forked as in a notebook."""

from __future__ import annotations

import csv
import functools
from pathlib import Path

import pytest

import lightning_canzona as lc
from lightning_canzona.cli import CanzonaCLI
from lightning_canzona.models import CausalLanguageModel
from lightning_canzona.telemetry import CLIPPED_HEADS, MAX_LOGIT

TINY_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.yaml"


def test_qk_clip_from_a_yaml_config_trains_forked_and_logs_the_clipped_heads(tmp_path) -> None:
    # The tiny model's logits start around 0.1–0.3: a threshold of 0.15 clips from the first step.
    config = tmp_path / "qk_clip.yaml"
    config.write_text(
        f"""
trainer:
  strategy: canzona_notebook
  devices: 2
  max_steps: 4
  log_every_n_steps: 1
  limit_val_batches: 0
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      save_dir: {tmp_path}
model:
  init_args:
    qk_norm: false
    optimizer:
      class_path: lightning_canzona.NorMuon
      init_args:
        lr: 0.02
        qk_clip:
          threshold: 0.15
data:
  init_args:
    seq_len: 32
    batch_size: 4
"""
    )
    cli = CanzonaCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        args=["--config", str(TINY_CONFIG), "--config", str(config)],
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as file:
        logged = [row for row in csv.DictReader(file) if row.get(MAX_LOGIT)]
    assert [int(row["step"]) for row in logged] == [0, 1, 2, 3]
    assert float(logged[0][MAX_LOGIT]) > 0.15 and float(logged[0][CLIPPED_HEADS]) > 0
    # Clipped to the threshold, the heads' logits stay near it while the model trains.
    assert all(float(row[MAX_LOGIT]) < 0.3 for row in logged[1:])


def test_qk_clip_on_a_model_with_qk_norm_is_refused_before_any_rank_starts() -> None:
    optimizer = functools.partial(lc.Muon, qk_clip=lc.QKClip(threshold=50.0))
    with pytest.raises(ValueError, match="qk_norm=False"):
        CausalLanguageModel(preset="tiny", optimizer=optimizer)
    CausalLanguageModel(preset="tiny", optimizer=optimizer, qk_norm=False)
    # From the command line: the model's own error, not jsonargparse's report of the types it tried.
    with pytest.raises(ValueError, match="^The optimizer's qk_clip bounds attention logits"):
        CanzonaCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_kwargs={"parser_mode": "omegaconf"},
            args=[
                "--config",
                str(TINY_CONFIG),
                "--model.init_args.optimizer.init_args.qk_clip.threshold",
                "50",
            ],
            run=False,
        )
