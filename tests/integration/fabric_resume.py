"""A Fabric loop that saves and resumes, which `test_fabric.py` launches on forked ranks: SOAP
(whose factors and eigenbases live with each matrix's owner) on the bundled model with 4
key/value heads (so that 4 TP ranks can split them), ``fabric.save`` after ``SAVED_AT`` steps and
``fabric.load`` at whatever mesh the resumed run has.
"""

from __future__ import annotations

import torch
from fabric_loop import ACCUMULATE, batches, loss_of
from lightning.fabric import Fabric

import lightning_canzona as lc
from lightning_canzona.checkpoint.state import full_model_state
from lightning_canzona.models.qwen3 import Qwen3, Qwen3Config

SAVED_AT = 2
SOAP = {"lr": 3e-3, "precondition_frequency": 1, "weight_decay": 0.01}
#: 256 tokens, width 128, MLP 384, 2 blocks of 4 query and 4 key/value heads of 32.
CONFIG = Qwen3Config(256, 128, 384, 2, 4, 4, head_dim=32, rope_theta=10_000.0)


def train(fabric: Fabric, checkpoint: str, phase: str) -> dict[str, torch.Tensor]:
    """The loop on the ranks ``fabric`` launched; ``phase`` ``"first"`` trains every step and saves
    the checkpoint on the way, ``"resumed"`` loads it and trains the remaining steps. Rank 0
    returns the trained weights whole."""
    torch.manual_seed(0)
    model = fabric.setup_module(Qwen3(CONFIG))
    optimizer = fabric.setup_optimizers(lc.SOAP(lc.matrix_param_groups(model), **SOAP))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if phase == "resumed":
        fabric.load(checkpoint, state)
    for step, micro_batches in enumerate(batches().split(ACCUMULATE)):
        if step < state["step"]:
            continue
        for index, tokens in enumerate(micro_batches):
            with fabric.no_backward_sync(model, enabled=index < ACCUMULATE - 1):
                fabric.backward(loss_of(model, tokens))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if phase == "first" and state["step"] == SAVED_AT:
            fabric.save(checkpoint, state)
    return full_model_state(model)
