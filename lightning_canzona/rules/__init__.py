"""Per-matrix update rules (pure math on full matrices) and elementwise AdamW.

`MatrixRule`, `UpdateCost`, `State` and `matrix_dims` are the public interface of a rule written
outside the package (docs: "Write your own matrix optimizer").
"""

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
