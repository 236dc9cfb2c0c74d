"""lightning_canzona: exact, non-redundant, load-balanced matrix optimizers for Lightning."""

from lightning_canzona.optim import SOAP, Muon, Shampoo, matrix_param_groups

__all__ = ["SOAP", "Muon", "Shampoo", "matrix_param_groups"]
__version__ = "0.1.0"
