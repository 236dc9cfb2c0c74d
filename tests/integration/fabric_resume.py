"""A Fabric loop that saves and resumes, which `test_fabric.py` launches on forked ranks: SOAP
(whose factors and eigenbases live with each matrix's owner) on the bundled model with 4
key/value heads (so that 4 TP ranks can split them) and 4 experts a block (stacks whose
matrices have owners of their own), ``fabric.save`` in both formats after ``SAVED_AT`` steps and
``fabric.load`` of each at whatever mesh the resumed run has.
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import torch
from fabric_loop import ACCUMULATE, batches, loss_of
from lightning.fabric import Fabric

import lightning_canzona as lc
from lightning_canzona.checkpoint.state import full_model_state, full_optimizer_state
from lightning_canzona.models.qwen3 import Qwen3, Qwen3Config

SAVED_AT = 2
SOAP = {"lr": 3e-3, "precondition_frequency": 1, "weight_decay": 0.01}
#: 256 tokens, width 128, 2 blocks of 4 query and 4 key/value heads of 32, and of 4 experts of
#: width 64 (2 a token).
CONFIG = Qwen3Config(
    256,
    128,
    384,
    2,
    4,
    4,
    head_dim=32,
    rope_theta=10_000.0,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
)


def single_file(checkpoint: str) -> str:
    """Where the run that saves ``checkpoint`` (a distributed checkpoint) saves a single file too."""
    return f"{checkpoint}.ckpt"


def whole_state(module: torch.nn.Module, optimizer: lc.SOAP) -> dict[str, Any]:
    """Copies of the whole weights and optimizer state on rank 0 (collective): a replicated tensor
    gathered on the CPU is the parameter's or the state's own, which training changes."""
    return copy.deepcopy(
        {"model": full_model_state(module), "optimizer": full_optimizer_state(module, optimizer)}
    )


def train(fabric: Fabric, checkpoint: str, phase: str) -> dict[str, Any]:
    """The loop on the ranks ``fabric`` launched; ``phase`` ``"first"`` trains every step and saves
    both checkpoints on the way, ``"resumed"`` loads the single file, then the distributed
    checkpoint, and trains the remaining steps. Rank 0 returns the trained weights whole
    (``"weights"``) and, resumed, the whole state each load restored (``"loaded"``, by format)."""
    torch.manual_seed(0)
    model = fabric.setup_module(Qwen3(CONFIG))
    optimizer = fabric.setup_optimizers(lc.SOAP(lc.matrix_param_groups(model), **SOAP))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    loaded: dict[str, Any] = {}
    if phase == "resumed":
        for name, path in [("single file", single_file(checkpoint)), ("distributed", checkpoint)]:
            fabric.load(path, state)
            loaded[name] = whole_state(model.module, optimizer.optimizer)
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
            # And as the strategy saves with save_distributed_checkpoint=False.
            with mock.patch.object(fabric.strategy, "_save_distributed_checkpoint", False):
                fabric.save(single_file(checkpoint), state)
    return {"weights": full_model_state(model), "loaded": loaded}
