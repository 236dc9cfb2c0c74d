"""The Trainer settings the tests share: 4 CPU devices, nothing logged, checkpointed or printed."""

from __future__ import annotations

from typing import Any

from lightning import Trainer

QUIET = {
    "accelerator": "cpu",
    "devices": 4,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def quiet_trainer(**settings: Any) -> Trainer:
    """A Trainer with `QUIET`'s settings; keywords add to or override them."""
    return Trainer(**{**QUIET, **settings})
