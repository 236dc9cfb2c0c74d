"""Matrix optimizers: the optimizer classes and their param groups."""

from lightning_canzona.optim.optimizer import MatrixOptimizer
from lightning_canzona.optim.optimizers import SOAP, Muon, NorMuon, Shampoo
from lightning_canzona.optim.param_groups import matrix_param_groups
from lightning_canzona.rules.newton_schulz import PRESETS, NewtonSchulzSchedule, newton_schulz

__all__ = [
    "PRESETS",
    "SOAP",
    "MatrixOptimizer",
    "Muon",
    "NewtonSchulzSchedule",
    "NorMuon",
    "Shampoo",
    "matrix_param_groups",
    "newton_schulz",
]
