"""Per-matrix update rules and elementwise AdamW; `MatrixRule` and `UpdateCost` are a rule's contract."""

from lightning_canzona.rules.adamw import adamw_step, init_adamw_state
from lightning_canzona.rules.base import MatrixRule, State, UpdateCost, matrix_dims
from lightning_canzona.rules.blocks import RowBlockRule
from lightning_canzona.rules.muon import MuonRule
from lightning_canzona.rules.normuon import NorMuonRule
from lightning_canzona.rules.shampoo import ShampooRule
from lightning_canzona.rules.soap import SOAPRule

__all__ = [
    "MatrixRule",
    "MuonRule",
    "NorMuonRule",
    "RowBlockRule",
    "SOAPRule",
    "ShampooRule",
    "State",
    "UpdateCost",
    "adamw_step",
    "init_adamw_state",
    "matrix_dims",
]
